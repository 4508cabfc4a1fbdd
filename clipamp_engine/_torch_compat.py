"""Every private torch symbol the engine relies on, behind one function each.

torch keeps these names out of its public API, so a release may rename or change them; each one
is used here and nowhere else in the engine, and ``tests/engine/test_torch_compat.py`` checks, per
function, that the symbol exists and behaves as the engine assumes. torch is pinned in
``pyproject.toml`` to the releases those tests pass on: adopting a new release means running them
and adapting the functions that fail.

What is used, and why:

- ``torch.amp.grad_scaler``: the scale and growth-tracker tensors (``GradScaler._scale``,
  ``_growth_tracker``), the per-optimizer inf checks (``_per_optimizer_states``, ``OptState``,
  ``_refresh_per_optimizer_state``): a fused optimizer unscales inside its own kernel, so its inf
  check is recorded the way ``GradScaler.unscale_`` + ``step`` record theirs, and a scaler with its
  own update rule reads and clears them as ``GradScaler.update`` does.
- ``Optimizer._step_supports_amp_scaling``: the flag ``GradScaler.step`` reads to hand a fused
  optimizer ``grad_scale`` / ``found_inf`` instead of unscaling first.
- ``torch.utils._foreach_utils._get_fused_kernels_supported_devices``: the device types torch's
  fused optimizer kernels run on.
- ``LRScheduler._last_lr``: what ``get_last_lr()`` returns, written when a schedule advanced on
  the device is brought up to date on the host.
- ``Tensor._values()``: a coalesced sparse COO tensor's values, aliasing its storage
  (``values()`` refuses the in-place updates clipping needs).
- ``sys.modules["torch.distributed.tensor"]``: the DTensor class when, and only when, something
  already imported it (importing it costs seconds and no DTensor can exist before).
- ``FSDPModule._get_fsdp_state()._fsdp_param_groups[i].fsdp_params`` and each ``FSDPParam``'s
  ``_unsharded_param.grad`` / ``unsharded_accumulated_grad``: where FSDP2 keeps the gradient of
  micro-batches run with ``set_requires_gradient_sync(False)``, not reduced yet. ``optimizer.zero_grad``
  clears only the sharded ``.grad`` and ``reset_iter_state`` keeps them; a step refused after some
  backward passes must drop them, or the next step's reduction adds them in.
- ``torch._dynamo.eval_frame.OptimizedModule._orig_mod``: the module a ``torch.compile`` wrapper
  runs, whose ``forward`` signature says how to pass it the targets (the wrapper's takes
  ``*args, **kwargs``); read only once ``torch.compile`` imported that module.

The ``torch._foreach_*`` kernels are documented (torch's "Foreach operations") and used directly.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

__all__ = [
    "compiled_original",
    "dtensor_class",
    "found_infs",
    "fsdp_drop_unreduced_grads",
    "fsdp_unreduced_grads",
    "fused_kernel_devices",
    "record_found_inf",
    "reset_inf_checks",
    "scale_tensors",
    "set_last_lr",
    "sparse_values",
    "takes_grad_scale",
]


def scale_tensors(scaler: torch.amp.GradScaler) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(scale, growth_tracker)``: the 0-dim fp32 / int32 device tensors the scaler updates in
    place, or ``None`` before its first ``scale()`` creates them."""
    if scaler._scale is None or scaler._growth_tracker is None:
        return None
    return scaler._scale, scaler._growth_tracker


def found_infs(scaler: torch.amp.GradScaler) -> list[torch.Tensor]:
    """The inf checks recorded this iteration (one ``found_inf`` tensor per optimizer and device)."""
    return [f for state in scaler._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]


def record_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """Record ``found_inf`` as ``optimizer``'s inf check of this iteration, as ``unscale_`` + ``step`` do."""
    state = scaler._per_optimizer_states[id(optimizer)]
    state["found_inf_per_device"] = {found_inf.device: found_inf}
    state["stage"] = OptState.STEPPED


def reset_inf_checks(scaler: torch.amp.GradScaler) -> None:
    """Forget this iteration's inf checks, as the end of ``GradScaler.update`` does."""
    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` divides by ``optimizer.grad_scale`` and skips on ``optimizer.found_inf``."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def fused_kernel_devices() -> list[str]:
    """The device types torch's fused optimizer kernels (``fused=True``) run on."""
    return list(_get_fused_kernels_supported_devices())


def set_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lrs: list[float]) -> None:
    """Make ``scheduler.get_last_lr()`` return ``lrs`` (one per param group)."""
    scheduler._last_lr = list(lrs)


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """The values of a coalesced sparse COO tensor, aliasing its storage (in-place ops keep it coalesced)."""
    return t._values()


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` if that module is already imported, else ``None``."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def compiled_original(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) runs, or ``None`` for any other module."""
    module = sys.modules.get("torch._dynamo.eval_frame")
    return model._orig_mod if module is not None and isinstance(model, module.OptimizedModule) else None


def _fsdp_params(model: torch.nn.Module) -> list:
    """Every ``FSDPParam`` of the ``fully_shard``-ed modules in ``model`` (``model`` included)."""
    states = (m._get_fsdp_state() for m in model.modules() if callable(getattr(m, "_get_fsdp_state", None)))
    return [p for state in states for group in state._fsdp_param_groups for p in group.fsdp_params]


def fsdp_unreduced_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients FSDP2 holds unreduced (accumulated under ``set_requires_gradient_sync(False)``): the
    unsharded parameters' ``.grad``, or, with a ``reduce_dtype`` that differs, the upcast accumulator."""
    out = []
    for p in _fsdp_params(model):
        unsharded = getattr(p, "_unsharded_param", None)  # absent before the first all-gather
        grads = (p.unsharded_accumulated_grad, None if unsharded is None else unsharded.grad)
        out += [g for g in grads if g is not None]
    return out


def fsdp_drop_unreduced_grads(model: torch.nn.Module) -> None:
    """Forget the gradients ``fsdp_unreduced_grads`` lists: the next backward starts from none."""
    for p in _fsdp_params(model):
        p.unsharded_accumulated_grad = None
        if getattr(p, "_unsharded_param", None) is not None:
            p._unsharded_param.grad = None
