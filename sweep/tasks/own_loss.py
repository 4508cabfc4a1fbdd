"""``model.loss_target=model``: a custom model that computes its own loss from the targets.

nanoGPT's ``model(idx, targets)`` returns ``(logits, loss)``; a ``transformers`` model called with
``labels=`` returns an output whose ``.loss`` is set. The runner calls ``loss_fn(model(inputs),
targets)`` everywhere (the engine's step, evaluation, the output check), so the model is wrapped:
``OwnLossModel(model)(inputs)`` defers the forward, and ``own_loss`` runs it with the targets —
inside the caller's autocast and autograd context — and takes the loss it returns, alone or in a tuple, a dict or
``.loss`` (``clipamp_engine.model_loss``). For byte targets the mean becomes the runner's
``(loss_sum, token_count)`` (the count of targets that are not padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from clipamp_engine.model_loss import model_loss

from .corpus import IGNORE


@dataclass(frozen=True)
class DeferredForward:
    """The forward of ``model`` on ``inputs``, run by the loss once the targets are known."""

    model: nn.Module
    inputs: Any


class OwnLossModel(nn.Module):
    """Wraps a model whose ``forward(inputs, targets)`` returns its loss; ``forward(inputs)`` defers."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Any) -> DeferredForward:
        return DeferredForward(self.model, inputs)


def own_loss(output: DeferredForward, targets: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The model's own loss on ``targets``: ``(loss_sum, token_count)`` for byte targets, else the mean."""
    loss = model_loss(output.model(output.inputs, targets)).float()
    if targets.dtype != torch.long:
        return loss
    count = (targets != IGNORE).sum()
    return loss * count, count
