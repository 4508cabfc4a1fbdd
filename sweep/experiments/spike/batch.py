"""The corrupted batch of the spike experiment: a binary blob whose loss is scaled to a target norm."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from clipamp_engine import total_norm
from clipamp_engine.step import DTYPES
from sweep.tasks.build import Batch


def binary_blob(batch: Batch, seed: int) -> Batch:
    """A batch of the same shape made of seeded uniform random bytes (inputs and next-byte targets)."""
    B, T = batch.inputs.shape
    g = torch.Generator().manual_seed(seed)
    blob = torch.randint(0, 256, (B, T + 1), generator=g, dtype=torch.int64).to(batch.inputs.device)
    return Batch(blob[:, :-1].contiguous(), blob[:, 1:].contiguous(), "binary_blob")


def grad_norm(model: torch.nn.Module, loss_fn: Callable, batch: Batch, dtype: str) -> float:
    """Global L2 norm of the token-mean loss's gradient on ``batch``; ``.grad`` and RNG untouched.

    bf16 runs are measured under bf16 autocast like the engine's step; fp16 and fp32 in fp32
    (an unscaled fp16 backward would underflow).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    device_type = params[0].device.type
    amp = torch.autocast(device_type, dtype=DTYPES["bf16"]) if dtype == "bf16" else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]):
        with amp:
            out = loss_fn(model(batch.inputs), batch.targets)
        loss = out[0].float() / out[1].clamp(min=1) if isinstance(out, tuple) else out.float()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return total_norm([g for g in grads if g is not None]).item()  # sync: once, at the spike step


class SpikeLoss:
    """``loss_fn`` that multiplies the loss of one marked batch (micro-batches included) by ``k``.

    The marked batch is recognised by the storage of its targets tensor, so every other batch
    (train, eval) goes through untouched.
    """

    def __init__(self, loss_fn: Callable) -> None:
        self.loss_fn = loss_fn
        self.marked: torch.Tensor | None = None
        self.k = 1.0

    def mark(self, targets: torch.Tensor, k: float) -> None:
        self.marked, self.k = targets, k

    def __call__(self, output: Any, targets: torch.Tensor) -> Any:
        out = self.loss_fn(output, targets)
        if self.marked is None or targets.untyped_storage().data_ptr() != self.marked.untyped_storage().data_ptr():
            return out
        return (out[0] * self.k, out[1]) if isinstance(out, tuple) else out * self.k


def running_peak(norms: dict[int, float], at_step: int, window: int) -> float:
    """Largest finite pre-clip norm of the ``window`` steps before ``at_step`` (0: all of them)."""
    first = at_step - window if window else 1
    values = [v for s, v in norms.items() if first <= s < at_step and math.isfinite(v)]
    return max(values) if values else math.nan
