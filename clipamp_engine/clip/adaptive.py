"""Thresholds that adapt online to the norms seen so far: AutoClip (quantile) and ZClip (z-score).

Neither syncs with the host inside ``clip_``: τ is computed branch-free on the device
(``torch.where`` / ``clamp``); only ``threshold`` reads a device value, once per step,
after the record's own sync.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..norms import scale_grads_
from .base import ClipPolicy, coefficient_above, host_float, positive

__all__ = ["QuantileClip", "ZScoreClip"]


# -- AutoClip (quantile) ---------------------------------------------------------------------


def _float_tensor(value: Any) -> torch.Tensor:
    """A checkpointed value as a tensor that keeps an fp64 dtype (lists and other dtypes: fp32)."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.float64:
        return value.detach().clone()
    return torch.as_tensor(value, dtype=torch.float32)


class QuantileClip(ClipPolicy):
    """AutoClip: clip at the q-quantile of the pre-clip norms seen so far.

    Two conventions for "so far", both offered (``include_current``):

    - ``True`` (default) — the paper's reference code: the current norm is appended to the
      history first, then τ_t = quantile_q(history ∪ {‖g_t‖}).
    - ``False`` — the ``autoclip`` package (``QuantileClip``, ``global_threshold=True``): τ_t
      is the q-quantile of the previous norms only (τ_1 = ∞), then ‖g_t‖ is appended.

    Including the current norm raises τ_t whenever that norm is above the quantile of the
    previous ones — the spike case — so a spike is clipped *less* under the paper's rule: at
    ``quantile=1.0`` τ_t = max(history ∪ {‖g_t‖}) ≥ ‖g_t‖ and nothing is ever clipped, while
    the package's rule clips a spike to the largest previous norm. Example, q = 0.9, previous
    norms 1, 2, …, 10 and a spike of 100: the package clips it to 9.1, the paper's rule to
    10 (the 0.9-quantile of 1…10 and 100). Both leave step 1 unclipped.

    Quantiles interpolate linearly, like ``np.percentile``. The paper keeps the whole
    history; here the last ``history`` norms (a device ring buffer, so no host sync). The
    paper's default percentile is p=10, i.e. ``quantile=0.1``: by design it clips most steps
    (~90% once the history is stationary); ``quantile=0.9``–``0.99`` turns it into a
    spike-only guard.

    Args:
        quantile: q in (0, 1] (the paper's percentile p / 100).
        history: how many recent pre-clip norms to keep (≥ 1).
        include_current: the paper's rule (``True``) or the ``autoclip`` package's (``False``).

    References:
        Seetharaman, Wichern, Pardo, Le Roux, "AutoClip: Adaptive Gradient Clipping for
        Source Separation Networks", arXiv:2007.14469.
    """

    mode = "quantile"

    def __init__(self, quantile: float = 0.1, history: int = 1000, include_current: bool = True) -> None:
        q = positive("quantile", quantile)
        if q > 1:
            raise ValueError(f"quantile={quantile!r} must be in (0, 1] (the paper's percentile p=10 is 0.1)")
        if int(history) != history or int(history) < 1:
            raise ValueError(f"history={history!r} must be an integer >= 1")
        if include_current not in (True, False):
            raise ValueError(
                f"include_current={include_current!r} must be true (the paper's rule) "
                "or false (the autoclip package's: previous norms only)"
            )
        self.quantile, self.history, self.include_current = q, int(history), bool(include_current)
        self._buf: torch.Tensor | None = None
        self._filled = 0  # entries written into the ring buffer (position = _filled % history)
        self.seen = 0  # norms observed in total
        self._tau: torch.Tensor | None = None

    def _ensure(self, pre: torch.Tensor) -> torch.Tensor:
        """The history buffer on ``pre``'s device, in its dtype (fp32, or fp64 for an fp64 model)."""
        if self._buf is None or self._buf.device != pre.device or self._buf.dtype != pre.dtype:
            old = self._buf
            self._buf = torch.zeros(self.history, dtype=pre.dtype, device=pre.device)
            if old is not None:
                self._buf.copy_(old)
        return self._buf

    def _record(self, buf: torch.Tensor, pre: torch.Tensor) -> None:
        buf[self._filled % self.history] = pre  # a device copy, no sync
        self._filled += 1
        self.seen += 1

    def clip_(self, params, grads, pre, step):
        buf = self._ensure(pre)
        if self.include_current:
            self._record(buf, pre)
        kept = min(self._filled, self.history)
        tau = torch.quantile(buf[:kept], self.quantile) if kept else None  # None: no history, τ = ∞
        if not self.include_current:
            self._record(buf, pre)
        self._tau = tau
        if tau is None:
            return pre
        coef = coefficient_above(pre, tau)
        scale_grads_(grads, coef)
        return pre * coef

    @property
    def threshold(self) -> float | None:
        return host_float(self._tau)

    def norms(self) -> torch.Tensor:
        """The kept norms, oldest first (CPU)."""
        if self._buf is None:
            return torch.zeros(0)
        n = min(self._filled, self.history)
        start = self._filled % self.history if self._filled > self.history else 0
        return torch.roll(self._buf[:n], -start).cpu() if n else torch.zeros(0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "quantile": self.quantile,
            "history": self.history,
            "include_current": self.include_current,
            "norms": self.norms(),
            "seen": self.seen,
            "tau": None if self._tau is None else self._tau.detach().cpu(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        norms = _float_tensor(state["norms"]).flatten()[-self.history :]
        device = self._buf.device if self._buf is not None else norms.device
        self._buf = torch.zeros(self.history, dtype=norms.dtype, device=device)
        self._buf[: len(norms)] = norms.to(device)
        self._filled = len(norms)
        self.seen = int(state.get("seen", len(norms)))
        tau = state.get("tau")
        self._tau = None if tau is None else _float_tensor(tau).to(device)


# -- ZClip (z-score) -------------------------------------------------------------------------

ZCLIP_OPTIONS = ("adaptive_scaling", "mean")


class ZScoreClip(ClipPolicy):
    """ZClip: clip norms that are z-score outliers against an EMA of mean and variance.

    Warm-up: the first ``warmup_steps`` norms are collected unclipped (only ``max_norm``, if
    set, applies) and initialise μ = mean, σ² = population variance of them. Then, per step
    with norm g::

        z = (g − μ) / (σ + eps·μ)
        if z > z_thresh:  τ = μ + (z_thresh² / z) · σ      ("adaptive_scaling", the paper's
                                                            reciprocal rule), or τ = μ ("mean")
                          g is clipped to τ (coefficient τ/g), and the EMA is fed τ
        else:             g is left untouched, and the EMA is fed g
        μ ← α μ + (1 − α) g_fed;   σ² ← α σ² + (1 − α)(g_fed − μ)²   (with the new μ)

    This is the authors' reference ``ZClip`` class (bluorion-com/ZClip, ``zclip/zclip.py``)
    in ``mode="zscore"`` with ``clip_factor=1``, ``skip_update_on_spike=False`` and
    ``max_grad_norm=None`` (its default is 1.0): only a step with z > z_thresh is clipped.
    ``τ = μ + z_thresh·σ / (z / z_thresh)`` there, identical to the paper's reciprocal form.
    The larger the outlier, the harder it is pulled back (τ → μ as z → ∞). Example: μ=1,
    σ=0.5, g=3 gives z=4 and, with z_thresh=2, τ = 1 + (4/4)·0.5 = 1.5 (with the default
    z_thresh=2.5, τ = 1.78125).

    Scale-free, unlike the reference: every decision and every ratio g_post/g is the same for
    a norm sequence and for that sequence times any constant (norms ~1e-5 late in a large
    model's training, or ~1e3 early). The reference adds an absolute ``eps=1e-6`` to σ and to
    g in its coefficient, which at norms ~1e-5 (σ ~ 1e-6) hides spikes; here ``eps`` is
    relative to μ and the coefficient is exactly τ/g. At norms ~1 the two agree.

    ``threshold`` is the bound in force at the latest step: τ when it clipped, otherwise the
    trigger level μ + z_thresh·(σ + eps·μ) above which it would have (both capped at
    ``max_norm``); ``None`` during warm-up without ``max_norm``.

    Args:
        alpha: EMA factor α (0.97).
        z_thresh: z-score above which a norm is a spike (2.5).
        warmup_steps: norms collected before the statistics start (25, ≥ 1).
        clip_option: ``"adaptive_scaling"`` (default) or ``"mean"``.
        max_norm: optional fixed ceiling also applied (``None``: none; the released code's
            ``max_grad_norm``).
        eps: guard added to σ in the z-score, relative to μ (``σ + eps·μ``; ≥ 0), so that a
            constant warm-up (σ = 0) still gives a finite z.

    References:
        Kumar, Owen, Chowdhury, Güra, "ZClip: Adaptive Spike Mitigation for LLM
        Pre-Training", arXiv:2504.02507.
    """

    mode = "zscore"

    def __init__(
        self,
        alpha: float = 0.97,
        z_thresh: float = 2.5,
        warmup_steps: int = 25,
        clip_option: str = "adaptive_scaling",
        max_norm: float | None = None,
        eps: float = 1e-6,
    ) -> None:
        self.alpha = float(alpha)
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha={alpha!r} must be in (0, 1)")
        self.z_thresh = positive("z_thresh", z_thresh)
        if int(warmup_steps) != warmup_steps or int(warmup_steps) < 1:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be an integer >= 1")
        self.warmup_steps = int(warmup_steps)
        if clip_option not in ZCLIP_OPTIONS:
            raise ValueError(f"clip_option={clip_option!r} is not one of {', '.join(ZCLIP_OPTIONS)}")
        self.clip_option = clip_option
        self.max_norm = None if max_norm is None else positive("max_norm", max_norm)
        self.eps = float(eps)
        if not (self.eps >= 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps={eps!r} must be a finite number >= 0 (relative to the mean norm)")
        self._warm: torch.Tensor | None = None
        self._n_warm = 0
        self.mean: torch.Tensor | None = None
        self.var: torch.Tensor | None = None
        self._tau: torch.Tensor | None = None

    def clip_(self, params, grads, pre, step):
        if self.mean is None:
            if self._warm is None:
                self._warm = torch.zeros(self.warmup_steps, dtype=pre.dtype, device=pre.device)
            elif self._warm.device != pre.device or self._warm.dtype != pre.dtype:  # restored from a checkpoint
                self._warm = self._warm.to(pre.device, pre.dtype)
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
        spread = std + self.eps * mean  # scales with the norms, so z does not
        z = (pre - mean) / spread
        spike = z > self.z_thresh
        if self.clip_option == "adaptive_scaling":
            target = mean + (self.z_thresh**2 / z) * std
        else:
            target = mean
        bound = torch.where(spike, target, torch.full_like(target, math.inf))  # only spikes are clipped
        tau = torch.where(spike, target, mean + self.z_thresh * spread)
        if self.max_norm is not None:
            bound = torch.clamp(bound, max=self.max_norm)
            tau = torch.clamp(tau, max=self.max_norm)
        coef = coefficient_above(pre, bound, eps=0.0)
        scale_grads_(grads, coef)
        fed = torch.where(spike, target, pre)
        a = self.alpha
        self.mean = a * mean + (1 - a) * fed
        self.var = a * var + (1 - a) * (fed - self.mean) ** 2
        self._tau = tau
        return pre * coef

    @property
    def threshold(self) -> float | None:
        return host_float(self._tau)

    def state_dict(self) -> dict[str, Any]:
        def cpu(t):
            return None if t is None else t.detach().cpu().clone()

        warm = self._warm[: self._n_warm] if self._warm is not None else torch.zeros(0)
        return {"mean": cpu(self.mean), "var": cpu(self.var), "warmup_norms": cpu(warm), "tau": cpu(self._tau)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        def tensor(v):
            return None if v is None else _float_tensor(v)

        self.mean, self.var = tensor(state["mean"]), tensor(state["var"])
        if (self.mean is None) != (self.var is None):
            raise ValueError("zscore state: mean and var must both be set or both be None")
        warm = _float_tensor(state.get("warmup_norms", [])).flatten()
        if self.mean is None and len(warm):
            if len(warm) >= self.warmup_steps:
                raise ValueError(f"zscore state holds {len(warm)} warm-up norms but warmup_steps={self.warmup_steps}")
            self._warm = torch.zeros(self.warmup_steps, dtype=warm.dtype)
            self._warm[: len(warm)] = warm
            self._n_warm = len(warm)
        else:
            self._warm, self._n_warm = None, 0
        self._tau = tensor(state.get("tau"))
