"""Clipping at thresholds fixed by the configuration: global norm, none, value, staged, per group.

``norm`` is the default: a projection of the whole gradient onto the τ-ball, so the
direction is kept. ``value`` and ``per_group`` change the direction; ``staged`` keeps a
fixed τ per training stage. None of these holds state worth a checkpoint.

References:
    Pascanu, Mikolov, Bengio, "On the difficulty of training recurrent neural networks",
    arXiv:1211.5063 (global-norm clipping).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence

import torch

from ..norms import clip_coefficient, dense_views, per_tensor_norms, total_norm
from .base import (
    ClipPolicy,
    GlobalCoefficientClip,
    NamedParams,
    compile_patterns,
    param_names,
    positive,
    refuse_unmatched,
    scale_each_,
)

__all__ = ["GlobalNormClip", "NoClip", "PerGroupClip", "StagedNormClip", "ValueClip"]


# -- norm / none -----------------------------------------------------------------------------


class GlobalNormClip(GlobalCoefficientClip):
    """Global L2 clipping at a fixed τ: ``g ← g · min(1, τ / (‖g‖ + 1e-6))`` (projection on the τ-ball)."""

    mode = "norm"

    def __init__(self, max_norm: float = 1.0) -> None:
        try:
            tau = float(max_norm)  # a str or None is refused here, not by a TypeError from the comparison
        except (TypeError, ValueError):
            tau = math.nan
        if not tau > 0:
            raise ValueError(f"max_norm={max_norm!r} must be > 0 (use clip mode 'none' to disable clipping)")
        self.max_norm = tau

    def coefficient(self, pre, step):
        return clip_coefficient(pre, self.max_norm)

    @property
    def threshold(self) -> float:
        return self.max_norm


class NoClip(GlobalCoefficientClip):
    """Measure and record norms, never clip (the coefficient is 1)."""

    mode = "none"

    def coefficient(self, pre, step):
        return torch.ones_like(pre)

    def clip_(self, params, grads, pre, step):
        return pre


# -- value ---------------------------------------------------------------------------------


class ValueClip(ClipPolicy):
    """Per-coordinate clamp ``g_i ← clip(g_i, −c, c)``.

    Changes the gradient's direction (coordinates are clipped independently); global-norm
    clipping is the usual choice unless there is a reason. Sparse gradients are clamped on
    their values. ``threshold`` reports ``c``, a per-coordinate bound, not a norm.

    Args:
        clip_value: the bound ``c`` (> 0), as in ``torch.nn.utils.clip_grad_value_``.
    """

    mode = "value"

    def __init__(self, clip_value: float = 1.0) -> None:
        self.clip_value = positive("clip_value", clip_value)

    def clip_(self, params, grads, pre, step):
        views = dense_views(grads)
        torch._foreach_clamp_min_(views, -self.clip_value)
        torch._foreach_clamp_max_(views, self.clip_value)
        return total_norm(grads)

    @property
    def threshold(self) -> float:
        return self.clip_value


# -- staged --------------------------------------------------------------------------------


class StagedNormClip(GlobalCoefficientClip):
    """Global-norm clipping whose τ depends on the step: stage-wise thresholds.

    ``stages=[[0, 2.0], [1000, 1.0]]`` clips at τ=2 for steps 1–999 and τ=1 from step 1000
    on (the last stage whose start ≤ step wins). A compromise between a fixed τ and
    a dynamic one: each training stage keeps a fixed, calibrated τ.

    Args:
        stages: ``[start_step, max_norm]`` pairs with strictly increasing starts, the first
            at 0 or 1 (steps are 1-based), every ``max_norm > 0``.
    """

    mode = "staged"

    def __init__(self, stages: Sequence[Sequence[float]] = ((0, 1.0),)) -> None:
        parsed = []
        try:
            for start, tau in stages:
                if float(start) != int(start) or int(start) < 0:
                    raise ValueError
                parsed.append((int(start), positive("stages max_norm", tau)))
        except (TypeError, ValueError) as e:
            detail = f" ({e})" if str(e) else ""
            raise ValueError(
                f"stages={stages!r} must be [[start_step, max_norm], ...] with integer "
                f"start_step >= 0 and max_norm > 0{detail}"
            ) from None
        if not parsed:
            raise ValueError("stages=[] is empty: give at least [[0, max_norm]]")
        starts = [s for s, _ in parsed]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"stages={stages!r}: start steps must be strictly increasing")
        if starts[0] > 1:
            raise ValueError(
                f"stages={stages!r}: the first stage must start at step 0 or 1 "
                f"(steps before {starts[0]} would have no threshold)"
            )
        self.stages = parsed
        self._starts = starts
        self._tau = parsed[0][1]

    def max_norm_at(self, step: int) -> float:
        """The τ of the stage that covers ``step``."""
        return self.stages[max(bisect.bisect_right(self._starts, step) - 1, 0)][1]

    def coefficient(self, pre, step):
        self._tau = self.max_norm_at(step)
        return clip_coefficient(pre, self._tau)

    def threshold_at(self, step: int) -> float:
        return self.max_norm_at(step)

    @property
    def threshold(self) -> float:
        return self._tau


# -- per group -----------------------------------------------------------------------------


class PerGroupClip(ClipPolicy):
    """Each optimizer param group, or each name pattern, is clipped to its own τ_j.

    ``s_j = min(1, τ_j / (‖g_j‖ + 1e-6))``, ``g_j ← s_j g_j``. Not a projection of the whole
    gradient: when the ``s_j`` differ, the full-model gradient *changes direction* — per-group
    clipping is a speed limit per module, useful when one module (an embedding,
    an auxiliary head, LoRA adapters) would otherwise dominate the global norm. The post-clip
    norm reported is the global norm of the result.

    Units are either the optimizer's param groups (by index, ``max_norms``) or, when
    ``patterns`` is given, name regexes (``re.search``; the first matching pattern wins, in
    the mapping's order) plus a remainder unit for unmatched parameters.

    Args:
        max_norms: τ per param group index; one value applies to every group. Needs
            ``optimizer``. Ignored when ``patterns`` is given.
        patterns: ``{regex: τ}`` over parameter names; needs ``named_params``.
        rest_max_norm: τ for parameters matching no pattern; ``None`` leaves them unclipped.
        named_params: ``model`` or ``model.named_parameters()`` (context).
        optimizer: the optimizer whose ``param_groups`` define the units (context).
    """

    mode = "per_group"
    needs_whole_params = True

    def __init__(
        self,
        max_norms: Sequence[float] = (1.0,),
        patterns: Mapping[str, float] | None = None,
        rest_max_norm: float | None = None,
        *,
        named_params: NamedParams | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self._unit_of: dict[int, int] = {}
        if patterns:
            if named_params is None:
                raise ValueError(
                    "per_group patterns select parameters by name: pass "
                    "named_params=model.named_parameters() (or the model)"
                )
            if not isinstance(patterns, Mapping):
                raise ValueError(f"patterns={patterns!r} must be a mapping {{regex: max_norm}}")
            regexes = compile_patterns(patterns, "per_group patterns")
            taus = [positive(f"patterns[{k!r}]", v) for k, v in patterns.items()]
            rest = math.inf if rest_max_norm is None else positive("rest_max_norm", rest_max_norm)
            names = param_names(named_params)
            for pid, name in names.items():
                self._unit_of[pid] = next((j for j, r in enumerate(regexes) if r.search(name)), len(regexes))
            chosen = list(self._unit_of.values())
            refuse_unmatched(
                "per_group patterns", list(patterns), list(names.values()), [chosen.count(j) for j in range(len(taus))]
            )
            self.max_norms = [*taus, rest]
        else:
            if optimizer is None:
                raise ValueError(
                    "per_group max_norms are by optimizer param-group index: pass optimizer=..., "
                    "or use patterns={regex: max_norm} with named_params"
                )
            if isinstance(max_norms, (int, float)):
                max_norms = [max_norms]
            taus = [positive("max_norms[]", v) for v in max_norms]
            n = len(optimizer.param_groups)
            if len(taus) == 1:
                taus = taus * n
            elif len(taus) != n:
                raise ValueError(
                    f"max_norms has {len(taus)} values but the optimizer has {n} param groups: "
                    f"give one value per group or a single value for all"
                )
            for j, group in enumerate(optimizer.param_groups):
                for p in group["params"]:
                    self._unit_of.setdefault(id(p), j)
            self.max_norms = taus
        self._tau: torch.Tensor | None = None
        self._index_key: tuple | None = None
        self._index: torch.Tensor | None = None

    def _indices(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        key = (device, *map(id, params))
        if key != self._index_key:
            try:
                units = [self._unit_of[id(p)] for p in params]
            except KeyError:
                raise ValueError(
                    "per_group: a parameter with a gradient is not among named_params / the "
                    "optimizer's param groups given at construction"
                ) from None
            self._index = torch.tensor(units, dtype=torch.long, device=device)
            self._index_key = key
        return self._index  # type: ignore[return-value]

    def clip_(self, params, grads, pre, step):
        norms = per_tensor_norms(grads)
        idx = self._indices(params, norms.device)
        if self._tau is None or self._tau.device != norms.device or self._tau.dtype != norms.dtype:
            # τ_j in the norms' dtype: an fp32 τ would round an fp64 run's coefficients (0.3 → 0.30000001)
            self._tau = torch.tensor(self.max_norms, dtype=norms.dtype, device=norms.device)
        unit_sq = torch.zeros(len(self.max_norms), dtype=norms.dtype, device=norms.device)
        unit_sq.index_add_(0, idx, norms * norms)
        coef = clip_coefficient(unit_sq.sqrt(), self._tau)[idx]  # τ = inf → 1
        scale_each_(grads, coef.unbind())
        # nothing clipped → exactly pre (a re-summed norm could differ in the last ulp and read as "clipped")
        return torch.where((coef == 1).all(), pre, torch.linalg.vector_norm(norms * coef))
