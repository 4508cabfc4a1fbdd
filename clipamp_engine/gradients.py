"""Gradient sources: how a step turns a micro-batch's loss into ``.grad``.

The default is the scaled backward of the loss (``ScaledBackward``); a clip policy that produces
the gradients itself (DP-SGD's clipped, noised per-example gradients,
``clipamp_engine.clip.dpsgd``) declares its own source through ``ClipPolicy.gradient_source``,
and ``AmpTrainState`` asks the source instead of the policy's type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["GradientSource", "ScaledBackward"]


class GradientSource:
    """Interface: ``backward`` writes one micro-batch's gradients; ``refusal`` names setups it cannot serve.

    ``builds_graph`` says whether the forward must record autograd (a source that differentiates
    the model itself, per example, needs only the loss value for the record).
    """

    builds_graph = True

    def refusal(
        self, *, has_loss_fn: bool, accumulation_steps: int, dtype: str, world_size: int, world_kind: str
    ) -> str | None:
        """Why this source cannot run under these settings (one line), or ``None`` when it can;
        ``has_loss_fn`` is false when the model computes its own loss."""
        return None

    def backward(
        self,
        loss: torch.Tensor,
        scaler: torch.amp.GradScaler,
        model: nn.Module,
        loss_fn: Callable[[Any, Any], Any],
        inputs: Any,
        targets: Any,
    ) -> None:
        raise NotImplementedError


class ScaledBackward(GradientSource):
    """``scaler.scale(loss).backward()``: gradients of the (loss-scaled) loss, accumulated in ``.grad``."""

    def backward(self, loss, scaler, model, loss_fn, inputs, targets) -> None:
        if not loss.requires_grad:  # metadata: no sync
            raise ValueError(
                "the loss does not require grad, so it has no gradient to step on: every parameter it depends on "
                "is frozen (requires_grad=False), or it was computed under torch.no_grad() or detached; unfreeze "
                "the parameters to train, or compute the loss from the model's output"
            )
        scaler.scale(loss).backward()
