"""The norm-pattern detectors behind ``clipamp_engine.diagnosis.diagnose``: each reads a run's
per-step trace and returns a ``Finding`` or ``None``. Numpy, and torch for the binomial interval of
``find_sustained_clipping`` (``clipamp_engine.band.clopper_pearson``)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .findings import CAUSES, Finding
from .records import StepLog


def _float(v: Any) -> float:
    if v is None or v == "":
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("true", "1", "yes")
    return bool(v) if v is not None and not (isinstance(v, float) and math.isnan(v)) else False


def trace_rows(records: Iterable[StepLog | Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r.row() if isinstance(r, StepLog) else r for r in records]


class Trace:
    """The columns diagnosis needs, as numpy arrays."""

    def __init__(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self.step = np.array([int(_float(r.get("step"))) for r in rows], dtype=np.int64)
        self.pre = np.array([_float(r.get("grad_l2_pre_clip")) for r in rows])
        self.post = np.array([_float(r.get("grad_l2_post_clip")) for r in rows])
        self.skipped = np.array([_bool(r.get("skipped")) for r in rows])
        self.reason = [str(r.get("skip_reason") or "") for r in rows]
        self.scale = np.array([_float(r.get("scaler_scale")) for r in rows])
        self.max_norm = np.array([_float(r.get("max_norm")) for r in rows])
        self.clipped_col = [r.get("clipped") for r in rows]
        self.source = [str(r.get("data_source") or "") for r in rows]
        self.at_floor = np.array([_bool(r.get("scaler_at_floor")) for r in rows])
        self.lr = np.array([_float(r.get("lr")) for r in rows])
        self.taken = ~self.skipped & np.isfinite(self.pre)

    def clipped(self, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` was clipped: the ``clipped`` column, else post < pre, else pre > max_norm."""
        out = []
        for i in rows:
            col = self.clipped_col[i]
            if col is not None and col != "":
                out.append(_bool(col))
            elif np.isfinite(self.post[i]):
                out.append(bool(self.post[i] < self.pre[i]))
            else:
                out.append(bool(np.isfinite(self.max_norm[i]) and self.pre[i] > self.max_norm[i]))
        return np.array(out, dtype=bool)


# -- the patterns ----------------------------------------------------------------------------


def find_nonfinite(t: Trace) -> Finding | None:
    bad = t.skipped | ~np.isfinite(t.pre)
    n = int(bad.sum())
    if not n:
        return None
    rate = n / len(bad)
    reasons = Counter(t.reason[i] or "nonfinite_norm" for i in np.flatnonzero(bad))
    severity = "error" if rate > 0.05 else "warning" if rate > 0.01 else "info"
    steps = t.step[bad].tolist()
    return Finding(
        "nonfinite",
        severity,
        f"{n} of {len(bad)} steps ({rate:.1%}) had a non-finite loss or gradient "
        f"({', '.join(f'{k}: {v}' for k, v in reasons.most_common())}); likely {CAUSES['nonfinite']}",
        steps,
        {"count": n, "rate": rate, "reasons": dict(reasons), "first_step": steps[0]},
    )


def find_zero_norm(t: Trace) -> Finding | None:
    zero = t.taken & (t.pre == 0)
    n = int(zero.sum())
    if not n:
        return None
    taken = int(t.taken.sum())
    severity = "error" if n == taken else "warning"
    return Finding(
        "zero_norm",
        severity,
        f"{n} of {taken} taken steps had a gradient norm of exactly 0; likely {CAUSES['zero_norm']}",
        t.step[zero].tolist(),
        {"count": n, "rate": n / taken},
    )


def find_spikes(t: Trace, window: int, factor: float, min_history: int) -> Finding | None:
    idx = np.flatnonzero(t.taken)
    norms = t.pre[idx]
    if len(norms) <= min_history:
        return None
    med = np.empty(len(norms))
    med[:min_history] = np.nan
    for j in range(min_history, min(window, len(norms))):  # partial windows at the start
        med[j] = np.median(norms[:j])
    if len(norms) > window:  # full windows, vectorised: med[j] = median(norms[j-window:j])
        med[window:] = np.median(np.lib.stride_tricks.sliding_window_view(norms[:-1], window), axis=1)
    with np.errstate(invalid="ignore"):
        mask = (med > 0) & (norms > factor * med)
    hits = np.flatnonzero(mask).tolist()
    medians = med[hits].tolist()
    if not hits:
        return None
    rows = idx[hits]
    steps = t.step[rows].tolist()
    ratios = [float(norms[j] / m) for j, m in zip(hits, medians)]
    evidence: dict[str, Any] = {
        "count": len(hits),
        "rate": len(hits) / len(norms),
        "norms": norms[hits].tolist(),
        "window_medians": medians,
        "ratios": ratios,
        "max_ratio": max(ratios),
        "factor": factor,
        "window": window,
    }
    message = (
        f"{len(hits)} norm spike(s) above {factor:g}× the median of the previous {window} finite norms "
        f"(worst {max(ratios):.1f}× at step {steps[int(np.argmax(ratios))]})"
    )
    sources = [t.source[i] for i in rows]
    if any(sources):
        spike_counts = Counter(sources)
        overall = Counter(t.source[i] for i in idx)
        top, top_n = spike_counts.most_common(1)[0]
        share, base = top_n / len(hits), overall[top] / len(idx)
        evidence.update(spike_sources=dict(spike_counts), source_share=share, source_base_rate=base)
        if top and share >= 0.5 and share > base:
            evidence["dominant_source"] = top
            message += f"; data_source {top!r} holds {share:.0%} of them (vs {base:.0%} of all steps)"
    message += f"; likely {CAUSES['spikes']}"
    severity = "warning" if len(hits) / len(norms) < 0.05 else "error"
    return Finding("spikes", severity, message, steps, evidence)


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx = np.argsort(np.argsort(x)).astype(float)
    ry = np.argsort(np.argsort(y)).astype(float)
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


def find_slow_growth(t: Trace, min_steps: int, min_rho: float, min_ratio: float) -> Finding | None:
    ok = t.taken & (t.pre > 0)
    steps, norms = t.step[ok], t.pre[ok]
    n = len(norms)
    if n < min_steps:
        return None
    rho = _spearman(steps.astype(float), norms)
    q = n // 4
    first, last = float(np.median(norms[:q])), float(np.median(norms[-q:]))
    ratio = last / first if first > 0 else math.inf
    tstat = rho * math.sqrt((n - 2) / max(1e-12, 1 - rho * rho))
    if not (rho >= min_rho and tstat > 3.0 and ratio >= min_ratio):
        return None
    slope = float(np.polyfit(steps.astype(float), np.log(norms), 1)[0])  # log-norm per step
    per_1000 = math.exp(slope * 1000)
    span = int(steps[-1] - steps[0]) + 1  # the run's steps, whatever the logging interval or the gaps
    over = f"{n} steps" if span == n else f"steps {int(steps[0])}–{int(steps[-1])} ({n} logged finite values)"
    return Finding(
        "slow_growth",
        "warning",
        f"the gradient norm rises steadily over {over} (Spearman ρ={rho:.2f}; last-quarter median "
        f"{last:.3g} is {ratio:.1f}× the first-quarter {first:.3g}; ×{per_1000:.3g} per 1000 steps); "
        f"likely {CAUSES['slow_growth']}",
        [int(steps[0]), int(steps[-1])],
        {
            "spearman_rho": rho,
            "t_stat": tstat,
            "first_quarter_median": first,
            "last_quarter_median": last,
            "ratio": ratio,
            "log_slope_per_step": slope,
            "growth_per_1000_steps": per_1000,
            "steps": n,
            "span_steps": span,
        },
    )


def find_always_clipped(t: Trace, max_ratio: float, min_steps: int) -> Finding | None:
    idx = np.flatnonzero(t.taken)
    if len(idx) < min_steps:
        return None
    clipped = t.clipped(idx)
    ratio = float(clipped.mean())
    if ratio <= max_ratio:
        return None
    norms = t.pre[idx]
    p50, p95 = (float(v) for v in np.percentile(norms, [50, 95]))
    taus = t.max_norm[idx][np.isfinite(t.max_norm[idx])]
    evidence = {
        "clip_ratio": ratio,
        "steps": len(idx),
        "norm_p50": p50,
        "norm_p95": p95,
        "max_norm_median": float(np.median(taus)) if len(taus) else None,
    }
    tau_txt = f"τ≈{evidence['max_norm_median']:.3g} vs " if len(taus) else ""
    return Finding(
        "always_clipped",
        "error" if ratio > 0.9 else "warning",
        f"{ratio:.0%} of {len(idx)} taken steps were clipped ({tau_txt}median norm {p50:.3g}, "
        f"p95 {p95:.3g}); likely {CAUSES['always_clipped']}",
        t.step[idx][clipped].tolist(),
        evidence,
    )


def _min_clips_above(window: int, above: float) -> int:
    """The fewest clipped steps of ``window`` whose exact 95% interval lies entirely above ``above``."""
    from .band import clopper_pearson

    return next((k for k in range(window + 1) if clopper_pearson(k, window)[0] > above), window + 1)


def find_sustained_clipping(t: Trace, window: int, above: float) -> Finding | None:
    """Rolling windows of ``window`` taken logged steps after the LR warm-up whose clipping ratio is above
    ``above`` beyond sampling noise (Clopper–Pearson lower bound > ``above``). Steps are the trace's own
    numbers: on a log of every N-th step the warm-up ends at a logged step and a window spans N·``window``
    steps, as the message says."""
    from .placement import warmup_end

    lr_rows = np.flatnonzero(np.isfinite(t.lr))
    end = warmup_end(t.lr[lr_rows].tolist())
    first = int(t.step[lr_rows[end - 1]]) if end else int(t.step[0])  # the step the LR stopped rising at
    idx = np.flatnonzero(t.taken & (t.step >= first))
    if len(idx) < window:
        return None
    counts = np.convolve(t.clipped(idx).astype(float), np.ones(window), "valid")
    rolling = counts / window
    over = np.flatnonzero(counts >= _min_clips_above(window, above))
    if not len(over):
        return None
    steps = t.step[idx]
    ends = steps[over + window - 1]  # the step each over-band rolling window ends at
    worst = int(np.argmax(rolling))
    gaps = np.diff(steps)
    n = int(np.bincount(gaps[gaps > 0]).argmax()) if (gaps > 0).any() else 1  # the logging interval
    span = f"{window} steps" if n == 1 else f"{window * n} steps ({window} logged, one every {n})"
    return Finding(
        "sustained_clipping",
        "warning",
        f"after the LR warm-up (step {first}) the clipping ratio over {span} "
        f"exceeded {above:.0%} beyond sampling noise in {len(over)} windows ending at steps "
        f"{int(ends[0])}–{int(ends[-1])} "
        f"(peak {rolling[worst]:.0%}, steps {int(steps[worst])}–{int(steps[worst + window - 1])}); "
        f"likely {CAUSES['sustained_clipping']}",
        ends.tolist(),
        {
            "window": window,
            "above": above,
            "peak_ratio": float(rolling[worst]),
            "windows_over": int(len(over)),
            "warmup_end": first,
            "log_interval": n,
        },
    )


def _scale_changes(t: Trace) -> tuple[list[int], list[int]]:
    """Row indices where the loss scale changed, and the direction (+1 / −1) of each change."""
    s = t.scale
    rows, dirs = [], []
    for i in range(1, len(s)):
        if np.isfinite(s[i]) and np.isfinite(s[i - 1]) and s[i] != s[i - 1]:
            rows.append(i)
            dirs.append(1 if s[i] > s[i - 1] else -1)
    return rows, dirs


def find_scale_oscillating(t: Trace, min_reversals: int, max_period: int) -> Finding | None:
    rows, dirs = _scale_changes(t)
    rev = [rows[k] for k in range(1, len(dirs)) if dirs[k] != dirs[k - 1]]
    if len(rev) < min_reversals:
        return None
    span = len(t.step)
    period = span / len(rev)
    if period > max_period:
        return None
    finite = t.scale[np.isfinite(t.scale)]
    return Finding(
        "scale_oscillating",
        "warning",
        f"the loss scale reversed direction {len(rev)} times in {span} steps (one reversal every "
        f"{period:.0f} steps, between {finite.min():g} and {finite.max():g}); likely "
        f"{CAUSES['scale_oscillating']}; consider a longer growth_interval or hysteresis",
        t.step[rev].tolist(),
        {
            "reversals": len(rev),
            "ups": dirs.count(1),
            "downs": dirs.count(-1),
            "period_steps": period,
            "min_scale_seen": float(finite.min()),
            "max_scale_seen": float(finite.max()),
        },
    )


def find_scale_at_floor(t: Trace, min_scale: float) -> Finding | None:
    rows, _ = _scale_changes(t)
    dynamic = bool(rows)  # a disabled scaler (bf16/fp32) reports a constant 1.0
    floor = t.at_floor | (dynamic & np.isfinite(t.scale) & (t.scale <= min_scale))
    if not floor.any():
        return None
    steps = t.step[floor].tolist()
    overflows_at_floor = int((floor & t.skipped).sum())
    return Finding(
        "scale_at_floor",
        "error",
        f"the loss scale sat at its floor (≤ {min_scale:g}) on {len(steps)} steps from step {steps[0]}, "
        f"{overflows_at_floor} of them overflowing; {CAUSES['scale_at_floor']}",
        steps,
        {"first_step": steps[0], "count": len(steps), "min_scale": min_scale, "overflows_at_floor": overflows_at_floor},
    )
