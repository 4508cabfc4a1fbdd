"""Update clipping: bound the optimizer's data update Δθ, not the gradient (for Adam they differ).

``UpdateProbe`` (the parameter snapshot that measures Δθ) is shared with the forensic
``update_norm`` column.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..norms import clip_coefficient, scale_grads_, total_norm
from .base import ClipPolicy, positive

__all__ = ["UpdateNormClip", "UpdateProbe", "is_decoupled"]


def is_decoupled(group: Mapping[str, Any], optimizer: torch.optim.Optimizer, override: bool | None) -> bool:
    """Whether ``group``'s weight decay is decoupled (AdamW-style ``θ ← θ(1 − lr·wd)``).

    ``override`` wins when given; otherwise the group's ``decoupled_weight_decay`` flag
    (torch ``Adam``/``AdamW``), else ``isinstance(optimizer, AdamW)``. Coupled (L2) decay
    is part of the gradient and therefore of the data update.
    """
    if override is not None:
        return override
    flag = group.get("decoupled_weight_decay")
    if flag is not None:
        return bool(flag)
    return isinstance(optimizer, torch.optim.AdamW)


class UpdateProbe:
    """Snapshot of parameters before an optimizer step, to measure (and bound) the data update.

    Memory: one copy of the snapshotted parameters in their own dtype, allocated once and
    reused while the set of parameters with gradients stays the same. Time: one copy before
    the step, two fused passes after (decay + difference, then the norm).

    The *data update* of a step is ``u = θ_new − θ_old · (1 − lr·wd)`` for param groups with
    decoupled weight decay (AdamW), and ``u = θ_new − θ_old`` otherwise (coupled L2 decay is
    in the gradient, so it is part of the data update).
    """

    def __init__(self, decoupled_weight_decay: bool | None = None) -> None:
        self.decoupled_weight_decay = decoupled_weight_decay
        self._key: tuple[int, ...] | None = None
        self._buffers: list[torch.Tensor] = []
        self._params: list[torch.Tensor] = []

    def snapshot(self, params: Sequence[torch.Tensor]) -> None:
        key = tuple(id(p) for p in params)
        if key != self._key:
            self._buffers = [torch.empty_like(p, memory_format=torch.preserve_format) for p in params]
            self._key = key
        self._params = list(params)
        with torch.no_grad():
            if self._buffers:
                torch._foreach_copy_(self._buffers, [p.detach() for p in params])

    def negative_update(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """Turn the snapshot into ``−u`` in place (``θ_old·(1 − lr·wd) − θ_new``) and return it."""
        where = {id(p): i for i, p in enumerate(self._params)}
        with torch.no_grad():
            for group in optimizer.param_groups:
                wd = group.get("weight_decay", 0.0)
                if not wd or not is_decoupled(group, optimizer, self.decoupled_weight_decay):
                    continue
                bufs = [self._buffers[where[id(p)]] for p in group["params"] if id(p) in where]
                if bufs:
                    torch._foreach_mul_(bufs, 1.0 - group["lr"] * wd)
            if self._buffers:
                torch._foreach_sub_(self._buffers, [p.detach() for p in self._params])
        return self._buffers

    @property
    def params(self) -> list[torch.Tensor]:
        return self._params


class UpdateNormClip(ClipPolicy):
    """Clip the optimizer's data update Δθ to norm ρ, after the optimizer computed it.

    For Adam the update is ``−lr · m̂/(√v̂ + ε)``, not ``−lr · g``: bounding ‖g‖ protects the
    moment estimates but does not bound the step (g=(1,1), √v̂+ε=(1,0.01) gives ‖u‖≈100 with
    ‖g‖=√2). This mode leaves the gradients alone (``clip_`` returns ``pre``), snapshots the
    parameters in ``before_step`` and, in ``after_step``, with the data update
    ``u = θ_new − θ_old·(1 − lr·wd)`` (decoupled weight decay excluded; ``u = θ_new − θ_old``
    for coupled L2, which is in the gradient and so part of u) sets::

        θ_new ← θ_old·(1 − lr·wd) + u · min(1, ρ / (‖u‖ + 1e-6))

    so weight decay is never clipped. ``after_step`` returns ``update_l2_pre_clip`` and
    ``update_l2_post_clip`` (0-dim tensors) for the record; ``last_update_norm`` keeps ‖u‖.
    The optimizer's moments saw the unclipped gradient, so they are not protected. One clip
    policy runs per step (``AmpTrainState`` takes one), so bounding both the gradient and the
    update needs a ``ClipPolicy`` of your own; the usual advice is to start with gradient
    clipping and switch to ``update`` when update-norm logs show the adaptive step blowing up.

    Cost: one copy of the parameters that have gradients, in their own dtype (allocated once
    and reused), one copy pass before the step and ~3 fused passes after it.

    Args:
        max_update_norm: ρ (> 0), in parameter units (it already includes the LR).
        decoupled_weight_decay: ``None`` detects per param group (``AdamW`` / the group's
            ``decoupled_weight_decay`` flag); ``True``/``False`` forces it.
    """

    mode = "update"
    needs_whole_params = True
    columns = ("update_l2_pre_clip", "update_l2_post_clip")

    def __init__(self, max_update_norm: float = 1.0, decoupled_weight_decay: bool | None = None) -> None:
        self.max_update_norm = positive("max_update_norm", max_update_norm)
        if decoupled_weight_decay not in (None, True, False):
            raise ValueError(f"decoupled_weight_decay={decoupled_weight_decay!r} must be null (detect), true or false")
        self._probe = UpdateProbe(decoupled_weight_decay)
        self.last_update_norm: torch.Tensor | None = None

    def clip_(self, params, grads, pre, step):
        return pre

    def before_step(self, params, optimizer):
        self._probe.snapshot(params)

    def after_step(self, params, optimizer):
        neg_u = self._probe.negative_update(optimizer)  # θ_old·(1 − lr·wd) − θ_new
        if not neg_u:
            return {}
        norm = total_norm(neg_u)
        coef = clip_coefficient(norm, self.max_update_norm)
        with torch.no_grad():
            scale_grads_(neg_u, 1.0 - coef)  # θ_new + (1 − c)(θ_decayed − θ_new) = θ_decayed + c·u
            torch._foreach_add_([p.detach() for p in self._probe.params], neg_u)
        self.last_update_norm = norm
        return {"update_l2_pre_clip": norm, "update_l2_post_clip": norm * coef}
