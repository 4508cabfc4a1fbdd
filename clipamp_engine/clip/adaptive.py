"""Clipping policies beyond the fixed global norm: value, staged, per-group, AGC, update, AutoClip, ZClip.

Each is a small ``ClipPolicy``; ``clipping.make_clip_policy`` is the dispatch point and
``clipping.CLIP_MODES`` the closed set. Every constructor option is a plain value (float,
int, str, bool, list, dict) with a default, so the app can expose them as config keys;
run-time objects (``named_params``, ``optimizer``) are keyword-only context arguments.

None of these syncs with the host inside ``clip_``: coefficients are computed branch-free
on the device (``torch.where`` / ``clamp``); only the ``threshold`` property of the adaptive
modes reads a device value, once per step, after the record's own sync.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .clip_base import (ClipPolicy, NamedParams, UpdateProbe, coefficient_above, compile_patterns,
                        embedding_param_ids, param_names, scale_each_)
from .norms import CLIP_EPS, clip_coefficient, dense_views, per_tensor_norms, scale_grads_, total_norm

__all__ = ["AdaptiveGradClip", "PerGroupClip", "QuantileClip", "StagedNormClip", "UpdateNormClip", "ValueClip",
           "ZScoreClip", "unitwise_norm"]


def _positive(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a number > 0") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    return v


def _host_float(t: torch.Tensor | None) -> float | None:
    return None if t is None else float(t)  # sync: a record field, read once per step after the record's sync


# -- value ---------------------------------------------------------------------------------

class ValueClip(ClipPolicy):
    """Per-coordinate clamp ``g_i ← clip(g_i, −c, c)``.

    Changes the gradient's direction (coordinates are clipped independently); the seed's
    advice is global-norm clipping unless there is a reason. Sparse gradients are clamped on
    their values. ``threshold`` reports ``c``, a per-coordinate bound, not a norm.

    Args:
        clip_value: the bound ``c`` (> 0), as in ``torch.nn.utils.clip_grad_value_``.
    """

    mode = "value"

    def __init__(self, clip_value: float = 1.0) -> None:
        self.clip_value = _positive("clip_value", clip_value)

    def clip_(self, params, grads, pre, step):
        views = dense_views(grads)
        torch._foreach_clamp_min_(views, -self.clip_value)
        torch._foreach_clamp_max_(views, self.clip_value)
        return total_norm(grads)

    @property
    def threshold(self) -> float:
        return self.clip_value


# -- staged --------------------------------------------------------------------------------

class StagedNormClip(ClipPolicy):
    """Global-norm clipping whose τ depends on the step: stage-wise thresholds.

    ``stages=[[0, 2.0], [1000, 1.0]]`` clips at τ=2 for steps 1–999 and τ=1 from step 1000
    on (the last stage whose start ≤ step wins). The seed's compromise between a fixed τ and
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
                parsed.append((int(start), _positive("stages max_norm", tau)))
        except (TypeError, ValueError) as e:
            detail = f" ({e})" if str(e) else ""
            raise ValueError(f"stages={stages!r} must be [[start_step, max_norm], ...] with integer "
                             f"start_step >= 0 and max_norm > 0{detail}") from None
        if not parsed:
            raise ValueError("stages=[] is empty: give at least [[0, max_norm]]")
        starts = [s for s, _ in parsed]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"stages={stages!r}: start steps must be strictly increasing")
        if starts[0] > 1:
            raise ValueError(f"stages={stages!r}: the first stage must start at step 0 or 1 "
                             f"(steps before {starts[0]} would have no threshold)")
        self.stages = parsed
        self._starts = starts
        self._tau = parsed[0][1]

    def max_norm_at(self, step: int) -> float:
        """The τ of the stage that covers ``step``."""
        return self.stages[max(bisect.bisect_right(self._starts, step) - 1, 0)][1]

    def clip_(self, params, grads, pre, step):
        self._tau = self.max_norm_at(step)
        coef = clip_coefficient(pre, self._tau)
        scale_grads_(grads, coef)
        return pre * coef

    @property
    def threshold(self) -> float:
        return self._tau


# -- per group -----------------------------------------------------------------------------

class PerGroupClip(ClipPolicy):
    """Each optimizer param group, or each name pattern, is clipped to its own τ_j.

    ``s_j = min(1, τ_j / (‖g_j‖ + 1e-6))``, ``g_j ← s_j g_j``. Not a projection of the whole
    gradient: when the ``s_j`` differ, the full-model gradient *changes direction* — per-group
    clipping is "按模块限速" (a speed limit per module), useful when one module (an embedding,
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

    def __init__(self, max_norms: Sequence[float] = (1.0,), patterns: Mapping[str, float] | None = None,
                 rest_max_norm: float | None = None, *, named_params: NamedParams | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self._unit_of: dict[int, int] = {}
        if patterns:
            if named_params is None:
                raise ValueError("per_group patterns select parameters by name: pass "
                                 "named_params=model.named_parameters() (or the model)")
            if not isinstance(patterns, Mapping):
                raise ValueError(f"patterns={patterns!r} must be a mapping {{regex: max_norm}}")
            regexes = compile_patterns(patterns, "per_group patterns")
            taus = [_positive(f"patterns[{k!r}]", v) for k, v in patterns.items()]
            rest = math.inf if rest_max_norm is None else _positive("rest_max_norm", rest_max_norm)
            self.unit_names = [*patterns, "<rest>"]
            for pid, name in param_names(named_params).items():
                self._unit_of[pid] = next((j for j, r in enumerate(regexes) if r.search(name)), len(regexes))
            self.max_norms = [*taus, rest]
        else:
            if optimizer is None:
                raise ValueError("per_group max_norms are by optimizer param-group index: pass optimizer=..., "
                                 "or use patterns={regex: max_norm} with named_params")
            if isinstance(max_norms, (int, float)):
                max_norms = [max_norms]
            taus = [_positive("max_norms[]", v) for v in max_norms]
            n = len(optimizer.param_groups)
            if len(taus) == 1:
                taus = taus * n
            elif len(taus) != n:
                raise ValueError(f"max_norms has {len(taus)} values but the optimizer has {n} param groups: "
                                 f"give one value per group or a single value for all")
            self.unit_names = [f"group{j}" for j in range(n)]
            for j, group in enumerate(optimizer.param_groups):
                for p in group["params"]:
                    self._unit_of.setdefault(id(p), j)
            self.max_norms = taus
        self._tau: torch.Tensor | None = None
        self._index_key: tuple | None = None
        self._index: torch.Tensor | None = None
        self.last_unit_norms: torch.Tensor | None = None

    def _indices(self, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        key = (device, *map(id, params))
        if key != self._index_key:
            try:
                units = [self._unit_of[id(p)] for p in params]
            except KeyError:
                raise ValueError("per_group: a parameter with a gradient is not among named_params / the "
                                 "optimizer's param groups given at construction") from None
            self._index = torch.tensor(units, dtype=torch.long, device=device)
            self._tau = torch.tensor(self.max_norms, dtype=torch.float32, device=device)
            self._index_key = key
        return self._index  # type: ignore[return-value]

    def clip_(self, params, grads, pre, step):
        norms = per_tensor_norms(grads)
        idx = self._indices(params, norms.device)
        unit_sq = torch.zeros(len(self.max_norms), dtype=torch.float32, device=norms.device)
        unit_sq.index_add_(0, idx, norms * norms)
        self.last_unit_norms = unit_sq.sqrt()
        coef = clip_coefficient(self.last_unit_norms, self._tau)[idx]  # τ = inf → 1
        scale_each_(grads, coef.unbind())
        # nothing clipped → exactly pre (a re-summed norm could differ in the last ulp and read as "clipped")
        return torch.where((coef == 1).all(), pre, torch.linalg.vector_norm(norms * coef))


# -- AGC -----------------------------------------------------------------------------------

#: Default AGC exclusions by name (embeddings); 1-D tensors (biases, norm scales) are excluded
#: by ``exclude_1d``, and ``nn.Embedding`` weights by type when ``named_params`` is the model.
DEFAULT_AGC_EXCLUDE = (r"(^|\.)(wte|wpe|tok|pos)\.weight$", r"embed")


def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """NFNets unit-wise L2 norm (fp32): one norm per output unit (dim 0), reduced over the
    other dims and kept broadcastable; a vector or scalar is a single unit."""
    if x.ndim <= 1:
        return torch.linalg.vector_norm(x, dtype=torch.float32)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True, dtype=torch.float32)


class AdaptiveGradClip(ClipPolicy):
    """Unit-wise adaptive gradient clipping (AGC, NFNets).

    For every unit *i* (a row of a weight matrix, an output channel of a conv kernel: dim 0,
    reduced over the other dims; a vector as one unit)::

        max_i = λ · max(‖W_i‖, eps)
        G_i ← G_i · max_i / ‖G_i‖   if ‖G_i‖ > max_i   (else unchanged)

    with ``λ = clip_factor``. A relative bound: the same gradient norm is fine for a large
    weight and too much for a small one. Units change by different factors, so the
    full gradient's direction changes. Biases, norm scales and embeddings have small or
    special norms and are excluded by default, as in the paper (which also leaves the final
    classifier unclipped: add its name to ``exclude``). Sparse gradients are never clipped
    by AGC. The unit norms cost one reduction per tensor (no fused kernel reduces over
    dims); the coefficients and the scaling are fused.

    Args:
        clip_factor: λ (paper: 0.01 for large batches; up to ~0.16 for small ones).
        eps: floor on the weight norm, so zero-initialised units can still move (1e-3).
        exclude: regexes (``re.search``) over parameter names to leave unclipped; ``None``
            means ``DEFAULT_AGC_EXCLUDE`` plus every ``nn.Embedding`` weight when
            ``named_params`` is the model (without ``named_params`` only ``exclude_1d``
            applies). Explicit non-empty patterns need ``named_params``.
        exclude_1d: leave 1-D (and 0-D) parameters unclipped (biases, norm scales).
        named_params: ``model`` or ``model.named_parameters()`` (context).

    References:
        Brock, De, Smith, Simonyan, "High-Performance Large-Scale Image Recognition Without
        Normalization", arXiv:2102.06171 (NFNets, AGC).
    """

    mode = "agc"

    def __init__(self, clip_factor: float = 0.01, eps: float = 1e-3, exclude: Sequence[str] | None = None,
                 exclude_1d: bool = True, *, named_params: NamedParams | None = None) -> None:
        self.clip_factor = _positive("clip_factor", clip_factor)
        self.eps = _positive("eps", eps)
        self.exclude_1d = bool(exclude_1d)
        if isinstance(exclude, str):
            exclude = [exclude]
        names = param_names(named_params)
        if exclude is None:
            patterns = DEFAULT_AGC_EXCLUDE
            self._excluded_ids = embedding_param_ids(named_params)
        else:
            patterns = tuple(exclude)
            self._excluded_ids = set()
            if patterns and named_params is None:
                raise ValueError("agc exclude patterns match parameter names: pass "
                                 "named_params=model.named_parameters() (or the model), or exclude=[]")
        regexes = compile_patterns(patterns, "agc exclude")
        self._excluded_ids |= {pid for pid, name in names.items() if any(r.search(name) for r in regexes)}
        self.exclude = list(patterns)
        self._key: tuple | None = None
        self._selected: list[int] = []

    def _select(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[int]:
        key = tuple(map(id, params))
        if key != self._key:
            self._selected = [i for i, (p, g) in enumerate(zip(params, grads))
                              if id(p) not in self._excluded_ids and not g.is_sparse
                              and not (self.exclude_1d and p.ndim <= 1)]
            self._key = key
        return self._selected

    def clip_(self, params, grads, pre, step):
        sel = self._select(params, grads)
        if not sel:
            return pre
        max_norms = [unitwise_norm(params[i].detach()) for i in sel]  # one reduction per tensor
        grad_norms = [unitwise_norm(grads[i]) for i in sel]
        torch._foreach_clamp_min_(max_norms, self.eps)
        torch._foreach_mul_(max_norms, self.clip_factor)
        torch._foreach_clamp_min_(grad_norms, CLIP_EPS)
        coef = torch._foreach_div(max_norms, grad_norms)
        torch._foreach_clamp_max_(coef, 1.0)
        scale_each_([grads[i] for i in sel], coef)
        return total_norm(grads)


# -- update --------------------------------------------------------------------------------

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
    The optimizer's moments saw the unclipped gradient, so they are not protected: combine
    with a gradient mode if that matters (the seed's advice: clip gradients first, add
    update clipping only when update-norm logs show the adaptive step is what blows up).

    Cost: one copy of the parameters that have gradients, in their own dtype (allocated once
    and reused), one copy pass before the step and ~3 fused passes after it.

    Args:
        max_update_norm: ρ (> 0), in parameter units (it already includes the LR).
        decoupled_weight_decay: ``None`` detects per param group (``AdamW`` / the group's
            ``decoupled_weight_decay`` flag); ``True``/``False`` forces it.
    """

    mode = "update"
    columns = ("update_l2_pre_clip", "update_l2_post_clip")

    def __init__(self, max_update_norm: float = 1.0, decoupled_weight_decay: bool | None = None) -> None:
        self.max_update_norm = _positive("max_update_norm", max_update_norm)
        if decoupled_weight_decay not in (None, True, False):
            raise ValueError(f"decoupled_weight_decay={decoupled_weight_decay!r} must be null (detect), true or false")
        self._probe = UpdateProbe(decoupled_weight_decay)
        self.last_update_norm: torch.Tensor | None = None
        self.last_update_norm_post: torch.Tensor | None = None

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
        self.last_update_norm, self.last_update_norm_post = norm, norm * coef
        return {"update_l2_pre_clip": norm, "update_l2_post_clip": norm * coef}


# -- AutoClip (quantile) ---------------------------------------------------------------------

class QuantileClip(ClipPolicy):
    """AutoClip: clip at the q-quantile of the pre-clip norms seen so far (current one included).

    As in the paper's reference code, the current norm is appended to the history first and
    τ_t = quantile_q(history) (linear interpolation, like ``np.percentile``); so the first
    step is never clipped (τ_1 = ‖g_1‖). The paper keeps the whole history; here the last
    ``history`` norms (a device ring buffer, so no host sync). The paper's default percentile
    is p=10, i.e. ``quantile=0.1``: by design it clips most steps (~90% once the history is
    stationary); ``quantile=0.9``–``0.99`` turns it into a spike-only guard.

    Args:
        quantile: q in (0, 1] (the paper's percentile p / 100).
        history: how many recent pre-clip norms to keep (≥ 1).

    References:
        Seetharaman, Wichern, Pardo, Le Roux, "AutoClip: Adaptive Gradient Clipping for
        Source Separation Networks", arXiv:2007.14469.
    """

    mode = "quantile"

    def __init__(self, quantile: float = 0.1, history: int = 1000) -> None:
        q = _positive("quantile", quantile)
        if q > 1:
            raise ValueError(f"quantile={quantile!r} must be in (0, 1] (the paper's percentile p=10 is 0.1)")
        if int(history) != history or int(history) < 1:
            raise ValueError(f"history={history!r} must be an integer >= 1")
        self.quantile, self.history = q, int(history)
        self._buf: torch.Tensor | None = None
        self._filled = 0  # entries written into the ring buffer (position = _filled % history)
        self.seen = 0  # norms observed in total
        self._tau: torch.Tensor | None = None

    def _ensure(self, device: torch.device) -> torch.Tensor:
        if self._buf is None or self._buf.device != device:
            old = self._buf
            self._buf = torch.zeros(self.history, dtype=torch.float32, device=device)
            if old is not None:
                self._buf.copy_(old)
        return self._buf

    def clip_(self, params, grads, pre, step):
        buf = self._ensure(pre.device)
        buf[self._filled % self.history] = pre  # a device copy, no sync
        self._filled += 1
        self.seen += 1
        tau = torch.quantile(buf[: min(self._filled, self.history)], self.quantile)
        coef = coefficient_above(pre, tau)
        scale_grads_(grads, coef)
        self._tau = tau
        return pre * coef

    @property
    def threshold(self) -> float | None:
        return _host_float(self._tau)

    def norms(self) -> torch.Tensor:
        """The kept norms, oldest first (CPU)."""
        if self._buf is None:
            return torch.zeros(0)
        n = min(self._filled, self.history)
        start = self._filled % self.history if self._filled > self.history else 0
        return torch.roll(self._buf[:n], -start).cpu() if n else torch.zeros(0)

    def state_dict(self) -> dict[str, Any]:
        return {"quantile": self.quantile, "history": self.history, "norms": self.norms(), "seen": self.seen,
                "tau": None if self._tau is None else self._tau.detach().cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        norms = torch.as_tensor(state["norms"], dtype=torch.float32).flatten()[-self.history:]
        device = self._buf.device if self._buf is not None else norms.device
        self._buf = torch.zeros(self.history, dtype=torch.float32, device=device)
        self._buf[: len(norms)] = norms.to(device)
        self._filled = len(norms)
        self.seen = int(state.get("seen", len(norms)))
        tau = state.get("tau")
        self._tau = None if tau is None else torch.as_tensor(tau, dtype=torch.float32, device=device)


# -- ZClip (z-score) -------------------------------------------------------------------------

ZCLIP_OPTIONS = ("adaptive_scaling", "mean")


class ZScoreClip(ClipPolicy):
    """ZClip: clip norms that are z-score outliers against an EMA of mean and variance.

    Warm-up: the first ``warmup_steps`` norms are collected unclipped (only ``max_norm``, if
    set, applies) and initialise μ = mean, σ² = population variance of them. Then, per step
    with norm g::

        z = (g − μ) / (σ + eps)
        if z > z_thresh:  τ = μ + (z_thresh² / z) · σ      ("adaptive_scaling", the paper's
                                                            reciprocal rule), or τ = μ ("mean")
                          g is clipped to τ, and the EMA is fed τ
        else:             the EMA is fed g
        μ ← α μ + (1 − α) g_fed;   σ² ← α σ² + (1 − α)(g_fed − μ)²   (with the new μ)

    This is the released implementation's ``mode="zscore"`` with ``clip_factor=1`` and
    ``skip_update_on_spike=False`` (``τ = μ + z_thresh·σ / (z / z_thresh)``, identical to
    the paper's reciprocal form). The larger the outlier, the harder it is pulled back
    (τ → μ as z → ∞). Example: μ=1, σ=0.5, g=3 gives z=4 and, with z_thresh=2,
    τ = 1 + (4/4)·0.5 = 1.5 (with the default z_thresh=2.5, τ = 1.78125).

    ``threshold`` is the bound in force at the latest step: τ when it clipped, otherwise the
    trigger level μ + z_thresh·σ (capped at ``max_norm``); ``None`` during warm-up without
    ``max_norm``.

    Args:
        alpha: EMA factor α (0.97).
        z_thresh: z-score above which a norm is a spike (2.5).
        warmup_steps: norms collected before the statistics start (25, ≥ 1).
        clip_option: ``"adaptive_scaling"`` (default) or ``"mean"``.
        max_norm: optional fixed ceiling also applied (``None``: none; the released code's
            ``max_grad_norm``).
        eps: added to σ in the z-score.

    References:
        Kumar, Owen, Chowdhury, Güra, "ZClip: Adaptive Spike Mitigation for LLM
        Pre-Training", arXiv:2504.02507.
    """

    mode = "zscore"

    def __init__(self, alpha: float = 0.97, z_thresh: float = 2.5, warmup_steps: int = 25,
                 clip_option: str = "adaptive_scaling", max_norm: float | None = None, eps: float = 1e-6) -> None:
        self.alpha = float(alpha)
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha={alpha!r} must be in (0, 1)")
        self.z_thresh = _positive("z_thresh", z_thresh)
        if int(warmup_steps) != warmup_steps or int(warmup_steps) < 1:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an integer >= 1")
        self.warmup_steps = int(warmup_steps)
        if clip_option not in ZCLIP_OPTIONS:
            raise ValueError(f"clip_option={clip_option!r} is not one of {', '.join(ZCLIP_OPTIONS)}")
        self.clip_option = clip_option
        self.max_norm = None if max_norm is None else _positive("max_norm", max_norm)
        self.eps = float(eps)
        self._warm: torch.Tensor | None = None
        self._n_warm = 0
        self.mean: torch.Tensor | None = None
        self.var: torch.Tensor | None = None
        self._tau: torch.Tensor | None = None

    @property
    def warming_up(self) -> bool:
        return self.mean is None

    def clip_(self, params, grads, pre, step):
        if self.mean is None:
            if self._warm is None:
                self._warm = torch.zeros(self.warmup_steps, dtype=torch.float32, device=pre.device)
            elif self._warm.device != pre.device:  # restored from a CPU checkpoint
                self._warm = self._warm.to(pre.device)
            self._warm[self._n_warm] = pre
            self._n_warm += 1
            if self._n_warm == self.warmup_steps:
                self.mean = self._warm.mean()
                self.var = self._warm.var(correction=0)
                self._warm, self._n_warm = None, 0
            if self.max_norm is None:
                self._tau = None
                return pre
            self._tau = torch.full_like(pre, self.max_norm)
            coef = coefficient_above(pre, self._tau)
            scale_grads_(grads, coef)
            return pre * coef

        mean, var = self.mean.to(pre.device), self.var.to(pre.device)
        std = var.sqrt()
        z = (pre - mean) / (std + self.eps)
        spike = z > self.z_thresh
        if self.clip_option == "adaptive_scaling":
            target = mean + (self.z_thresh ** 2 / z) * std
        else:
            target = mean
        tau = torch.where(spike, target, mean + self.z_thresh * std)
        if self.max_norm is not None:
            tau = torch.clamp(tau, max=self.max_norm)
        coef = coefficient_above(pre, tau)
        scale_grads_(grads, coef)
        fed = torch.where(spike, target, pre)
        a = self.alpha
        self.mean = a * mean + (1 - a) * fed
        self.var = a * var + (1 - a) * (fed - self.mean) ** 2
        self._tau = tau
        return pre * coef

    @property
    def threshold(self) -> float | None:
        return _host_float(self._tau)

    def state_dict(self) -> dict[str, Any]:
        def cpu(t):
            return None if t is None else t.detach().cpu().clone()
        warm = self._warm[: self._n_warm] if self._warm is not None else torch.zeros(0)
        return {"mean": cpu(self.mean), "var": cpu(self.var), "warmup_norms": cpu(warm), "tau": cpu(self._tau)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def tensor(v):
            return None if v is None else torch.as_tensor(v, dtype=torch.float32)
        self.mean, self.var = tensor(state["mean"]), tensor(state["var"])
        if (self.mean is None) != (self.var is None):
            raise ValueError("zscore state: mean and var must both be set or both be None")
        warm = torch.as_tensor(state.get("warmup_norms", []), dtype=torch.float32).flatten()
        if self.mean is None and len(warm):
            if len(warm) >= self.warmup_steps:
                raise ValueError(f"zscore state holds {len(warm)} warm-up norms but warmup_steps={self.warmup_steps}")
            self._warm = torch.zeros(self.warmup_steps, dtype=torch.float32)
            self._warm[: len(warm)] = warm
            self._n_warm = len(warm)
        else:
            self._warm, self._n_warm = None, 0
        self._tau = tensor(state.get("tau"))
