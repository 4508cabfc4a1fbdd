"""Per-step gradient forensics: update norm, parameter norm, top-k gradient norms, zero gradients.

``StepForensics`` implements the probe protocol ``AmpTrainState(forensics=...)`` calls on
every taken step: ``before_step(params, grads, optimizer)`` after clipping and before the
optimizer update, then ``after_step(params, optimizer) -> dict`` whose keys become extra
record (CSV) columns. All device work is fused (``torch._foreach_*``) and everything is read
back with one host sync per step. Each flag that is off skips its work entirely; with all
off the probe costs nothing (but pass ``forensics=None`` then).

What the columns say (the update norm: how far Adam's preconditioned step really moves the
weights; per-layer norms: which layers trigger an anomaly; a norm of exactly zero: a detached
graph or frozen parameters):

- ``update_norm``: ‖u‖ of the data update actually applied this step,
  ``u = θ_new − θ_old·(1 − lr·wd)`` for decoupled weight decay (AdamW), i.e. weight decay
  *excluded* (the update the optimizer itself makes); ``θ_new − θ_old`` otherwise. Measured
  after any ``update``-mode clipping, so it is the update the parameters really received.
  Cost: one copy of the trainable parameters that have gradients (their dtype), reused.
- ``param_norm``: ‖θ‖ over all trainable parameters after the step.
- ``top_grad_params``: the ``top_k`` trainable parameters by (post-clip) gradient norm, as
  ``"name:norm;name:norm"`` (names from ``named_params``, else ``param<i>`` in optimizer order).
- ``zero_grad_count``: trainable parameters whose gradient is exactly all-zero or absent
  (``None``): in both cases the parameter did not learn this step.

"Trainable" = in the optimizer's param groups and ``requires_grad``.
"""

from __future__ import annotations

from typing import Any

import torch

from .clip.base import NamedParams, param_names
from .clip.update import UpdateProbe
from .norms import per_tensor_norms, total_norm

__all__ = ["FORENSICS_COLUMNS", "StepForensics"]

#: Every column ``StepForensics`` can produce, in order.
FORENSICS_COLUMNS = ("update_norm", "param_norm", "top_grad_params", "zero_grad_count")


class StepForensics:
    """Forensic columns for every taken step (see the module docstring for their meaning).

    Args:
        named_params: ``model`` or ``model.named_parameters()`` for readable names.
        update_norm: measure ‖Δθ‖ (decoupled weight decay excluded); needs a parameter copy.
        param_norm: measure ‖θ‖ after the step.
        top_k: how many parameters to list by gradient norm (0: off).
        zero_grads: count all-zero / absent gradients (one fused L1-norm pass).
        decoupled_weight_decay: ``None`` detects AdamW-style decay per group; a bool forces it.
    """

    def __init__(
        self,
        named_params: NamedParams | None = None,
        *,
        update_norm: bool = True,
        param_norm: bool = True,
        top_k: int = 3,
        zero_grads: bool = True,
        decoupled_weight_decay: bool | None = None,
    ) -> None:
        if not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k={top_k!r} must be an integer >= 0 (0 turns the column off)")
        self.names = param_names(named_params)
        self.update_norm, self.param_norm = bool(update_norm), bool(param_norm)
        self.top_k, self.zero_grads = top_k, bool(zero_grads)
        self._probe = UpdateProbe(decoupled_weight_decay) if self.update_norm else None
        self._trainable_key: tuple | None = None
        self._trainable: list[torch.Tensor] = []
        self._labels: list[str] = []
        self._pending: dict[str, torch.Tensor] = {}
        self._top_index: list[int] = []

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns ``after_step`` returns with these flags (for a CSV header)."""
        on = (self.update_norm, self.param_norm, self.top_k > 0, self.zero_grads)
        return tuple(c for c, flag in zip(FORENSICS_COLUMNS, on) if flag)

    def _trainables(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        key = tuple(map(id, params))
        if key != self._trainable_key:
            self._trainable, self._trainable_key = params, key
            self._labels = [self.names.get(id(p), f"param{i}") for i, p in enumerate(params)]
        return self._trainable

    def before_step(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], optimizer: torch.optim.Optimizer
    ) -> None:
        """After clipping, before the update: grad statistics and the parameter snapshot."""
        self._pending = {}
        if self.top_k or self.zero_grads:
            trainable = self._trainables(optimizer)
            position = {id(p): i for i, p in enumerate(trainable)}
            pairs = [(position[id(p)], g) for p, g in zip(params, grads) if id(p) in position]
            tensors = [g for _, g in pairs]
            if self.top_k and tensors:
                norms = per_tensor_norms(tensors)
                k = min(self.top_k, len(tensors))
                values, idx = torch.topk(norms, k)
                self._top_index = [pos for pos, _ in pairs]  # maps topk indices back to trainables
                self._pending["top_values"] = values
                self._pending["top_idx"] = idx.float()
            if self.zero_grads:
                # L1, not L2 (whose squares underflow for tiny entries) nor max-abs (slow on CPU):
                # a sum of |x| is 0 exactly when every entry is 0
                nonzero = (per_tensor_norms(tensors, 1.0) > 0).sum() if tensors else None
                missing = len(trainable) - len(tensors)
                zero = torch.tensor(float(missing)) if nonzero is None else (len(tensors) - nonzero) + missing
                self._pending["zero"] = zero.float()
        if self._probe is not None:
            self._probe.snapshot(params)

    def after_step(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """After the update: the step's columns, read back with one host sync."""
        parts: list[tuple[str, torch.Tensor]] = []
        if self._probe is not None:
            neg_u = self._probe.negative_update(optimizer)
            parts.append(("update_norm", total_norm(neg_u).reshape(1)))
        if self.param_norm:
            trainable = self._trainables(optimizer)
            parts.append(("param_norm", total_norm([p.detach() for p in trainable]).reshape(1)))
        if "zero" in self._pending:
            parts.append(("zero_grad_count", self._pending["zero"].reshape(1)))
        if "top_values" in self._pending:
            parts.append(("top_values", self._pending["top_values"]))
            parts.append(("top_idx", self._pending["top_idx"]))
        if not parts:
            return {}
        device = parts[0][1].device
        flat = torch.cat([t.to(device, torch.float32) for _, t in parts]).tolist()  # sync: the step's columns
        out: dict[str, Any] = {}
        pos = 0
        values: dict[str, list[float]] = {}
        for name, t in parts:
            values[name] = flat[pos : pos + t.numel()]
            pos += t.numel()
        if "update_norm" in values:
            out["update_norm"] = values["update_norm"][0]
        if "param_norm" in values:
            out["param_norm"] = values["param_norm"][0]
        if self.top_k:
            tops = zip(values.get("top_idx", []), values.get("top_values", []))
            out["top_grad_params"] = ";".join(f"{self._labels[self._top_index[int(i)]]}:{v:.4g}" for i, v in tops)
        if "zero_grad_count" in values:
            out["zero_grad_count"] = int(values["zero_grad_count"][0])
        self._pending = {}
        return out


class NoForensics:
    """Forensics off: no snapshots, no extra columns."""

    columns: tuple[str, ...] = ()

    def before_step(self, params, grads, optimizer) -> None:
        pass

    def after_step(self, params, optimizer) -> dict[str, Any]:
        return {}
