"""Fault injection as config (``faults.*``, ``FaultsConfig``; off by default), usable from any experiment.

Each fault names the steps it hits. Gradient faults write into the first trainable parameter's
gradient during backward; loss faults act on the loss the engine checks; ``overflow`` multiplies
the model output in its own dtype (fp16 → inf; bf16/fp32 → a finite, huge loss); ``nan_input``
writes a NaN into the first layer's input (or, for byte ids, into the embedding's output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from sweep.config.schema import FAULTS, FaultsConfig


def _first_trainable(model: nn.Module) -> nn.Parameter:
    return next(p for p in model.parameters() if p.requires_grad)


class FaultInjector:
    """Applies ``FaultsConfig`` to a model and loss at the configured steps (1-based).

    ``batch(step, batch)`` must be called before each step (it sets the current step);
    ``loss_fn`` wraps the task's loss. Hooks are only installed for faults that are configured.
    """

    def __init__(self, cfg: FaultsConfig, model: nn.Module, loss_fn: Callable) -> None:
        self.cfg = cfg
        self.steps = {name: set(getattr(cfg, name)) for name in FAULTS}
        self._loss_fn = loss_fn
        self.step = 0
        self._grad_done = False
        self.fired: list[tuple[int, str]] = []
        if self.steps["inf_grad"] or self.steps["nan_grad"]:
            _first_trainable(model).register_hook(self._grad_hook)
        if self.steps["overflow"]:
            model.register_forward_hook(self._overflow_hook)
        if self.steps["nan_input"]:
            emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
            if emb is not None:
                emb.register_forward_hook(lambda m, i, out: self._poison(out, "nan_input"))
            else:
                model.register_forward_pre_hook(lambda m, args: (self._poison(args[0], "nan_input"), *args[1:]))

    @property
    def active(self) -> bool:
        return any(self.steps.values())

    def _hit(self, name: str) -> bool:
        return self.step in self.steps[name]

    def _note(self, name: str) -> None:
        if (self.step, name) not in self.fired:
            self.fired.append((self.step, name))

    def batch(self, step: int, batch: Any) -> Any:
        self.step, self._grad_done = step, False
        if self._hit("loss_spike") and batch.targets.is_floating_point():
            self._note("loss_spike")
            return type(batch)(batch.inputs, batch.targets * self.cfg.spike_factor, batch.data_source)
        return batch

    def loss_fn(self, output: Any, targets: Any):
        result = self._loss_fn(output, targets)
        factor = None
        if self._hit("nan_loss"):
            factor, name = float("nan"), "nan_loss"
        elif self._hit("loss_spike") and not targets.is_floating_point():
            factor, name = self.cfg.spike_factor, "loss_spike"
        if factor is None:
            return result
        self._note(name)
        if isinstance(result, tuple):
            return result[0] * factor, result[1]
        return result * factor

    def _grad_hook(self, grad: torch.Tensor) -> torch.Tensor:
        for name, value in (("inf_grad", float("inf")), ("nan_grad", float("nan"))):
            if self._hit(name) and not self._grad_done:
                self._grad_done = True
                self._note(name)
                grad = grad.clone()
                grad.view(-1)[0] = value
        return grad

    def _overflow_hook(self, module, inputs, output):
        if self._hit("overflow"):
            self._note("overflow")
            return output * torch.tensor(self.cfg.overflow_factor, dtype=output.dtype)
        return output

    def _poison(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if not self._hit(name):
            return x
        self._note(name)
        x = x.clone()
        x.view(-1)[0] = float("nan")
        return x
