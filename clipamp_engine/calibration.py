"""Norm calibration windows: measure pre-clip norms for a while, then pick τ from their quantiles.

A calibration window is a short training interval used to estimate typical gradient-norm
percentiles before fixing (or revising) the clipping threshold; τ = Quantile_q of the window's
finite pre-clip norms clips only the spikes (q = 0.95 by default). Skipped steps are counted,
never mixed into the quantiles. Quantiles use linear interpolation in float64, i.e. exactly
``numpy.quantile``'s default.

References:
    Seed lesson 004, "Choosing the threshold" and "Norm Calibration Window".
    Seetharaman et al., "AutoClip", arXiv:2007.14469 (percentile-based thresholds).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .records import StepLog

REPORTED_QUANTILES = (0.5, 0.9, 0.95, 0.99)


class CalibrationError(ValueError):
    """A calibration window cannot recommend a threshold (e.g. every step of it was skipped)."""


def quantiles(values: Sequence[float], qs: Iterable[float]) -> list[float]:
    """Linear-interpolation quantiles (numpy's default) of ``values``; NaN for an empty set."""
    qs = list(qs)
    if not values:
        return [math.nan] * len(qs)
    data = torch.tensor(list(values), dtype=torch.float64)
    return torch.quantile(data, torch.tensor(qs, dtype=torch.float64)).tolist()


@dataclass
class CalibrationSummary:
    """What a window saw and what it recommends."""

    start_step: int
    end_step: int
    n_finite: int
    n_skipped: int
    quantiles: dict[str, float]  # "p50", "p90", "p95", "p99", "max"
    token_quantiles: dict[str, float]  # the same over ‖g‖·√N_tok (empty without token counts)
    quantile: float
    recommended_max_norm: float
    candidate_clip_ratios: dict[float, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "start_step": self.start_step, "end_step": self.end_step,
            "n_finite": self.n_finite, "n_skipped": self.n_skipped,
            "quantiles": self.quantiles, "token_normalised_quantiles": self.token_quantiles,
            "quantile": self.quantile, "recommended_max_norm": self.recommended_max_norm,
            "candidate_clip_ratios": {f"{k:g}": v for k, v in self.candidate_clip_ratios.items()},
        }

    def as_state(self) -> dict[str, Any]:
        """Plain values for a checkpoint; ``CalibrationSummary(**state)`` restores it exactly."""
        return dataclasses.asdict(self)


def _label(q: float) -> str:
    return f"p{q * 100:g}"


class NormCalibrator:
    """Collects the pre-clip norms of one window and summarises them.

    Args:
        quantile: q for the recommendation τ = Quantile_q (0 < q < 1).
        candidates: fixed thresholds whose would-be clipping ratio is reported too.
    """

    def __init__(self, quantile: float = 0.95, candidates: Sequence[float] = (0.5, 1.0, 2.0, 5.0)) -> None:
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile={quantile!r} must be in (0, 1), e.g. 0.95")
        self.quantile = quantile
        self.candidates = tuple(candidates)
        self.norms: list[float] = []
        self.token_norms: list[float] = []
        self.steps: list[int] = []
        self.n_skipped = 0

    def add(self, log: StepLog) -> None:
        self.steps.append(log.step)
        if log.skipped or not math.isfinite(log.grad_l2_pre_clip):
            self.n_skipped += 1
            return
        self.norms.append(log.grad_l2_pre_clip)
        if log.token_count:
            self.token_norms.append(log.grad_l2_pre_clip * math.sqrt(log.token_count))

    def state_dict(self) -> dict[str, Any]:
        return {"norms": list(self.norms), "token_norms": list(self.token_norms), "steps": list(self.steps),
                "n_skipped": self.n_skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norms, self.token_norms = list(state["norms"]), list(state["token_norms"])
        self.steps, self.n_skipped = list(state["steps"]), int(state["n_skipped"])

    def clip_ratio_at(self, tau: float) -> float:
        """Share of the window's finite norms above τ (the steps τ would have clipped)."""
        if not self.norms:
            return math.nan
        return sum(n > tau for n in self.norms) / len(self.norms)

    def summary(self) -> CalibrationSummary:
        if not self.norms:
            raise CalibrationError(
                f"calibration window (steps {self.steps[0] if self.steps else '?'}-"
                f"{self.steps[-1] if self.steps else '?'}) has no finite norm: every step was skipped")
        qs = list(REPORTED_QUANTILES)
        values = quantiles(self.norms, qs + [self.quantile])
        named = {_label(q): v for q, v in zip(qs, values)}
        named["max"] = max(self.norms)
        tok = {}
        if self.token_norms:
            tok = {_label(q): v for q, v in zip(qs, quantiles(self.token_norms, qs))}
            tok["max"] = max(self.token_norms)
        tau = values[-1]
        thresholds = sorted({*self.candidates, *(named[_label(q)] for q in qs), tau})
        return CalibrationSummary(
            start_step=self.steps[0], end_step=self.steps[-1], n_finite=len(self.norms),
            n_skipped=self.n_skipped, quantiles=named, token_quantiles=tok, quantile=self.quantile,
            recommended_max_norm=tau, candidate_clip_ratios={t: self.clip_ratio_at(t) for t in thresholds})


class CalibrationWindows:
    """Where the calibration windows of a run lie: the first at step 1, then one every ``every`` steps.

    Each window is ``window`` steps long; with ``total_steps`` known, a window cut short by the
    end of the run is kept only if it still has 2 steps (a quantile of one norm says nothing).

    Args:
        window: steps per window (>= 2).
        every: steps between window starts (0: one window; else >= ``window``, no overlap).
        total_steps: the run length, if known (``None``: windows never end early).
    """

    def __init__(self, window: int = 100, every: int = 0, total_steps: int | None = None) -> None:
        if not _is_int(window) or window < 2:
            raise ValueError(f"window={window!r} must be an integer >= 2 steps")
        if not _is_int(every) or every < 0 or (every and every < window):
            raise ValueError(f"every={every!r} must be 0 (one window) or an integer >= window={window}")
        if total_steps is not None and (not _is_int(total_steps) or total_steps < 1):
            raise ValueError(f"total_steps={total_steps!r} must be an integer >= 1 (or None: unknown)")
        self.window, self.every, self.total_steps = int(window), int(every), total_steps

    def window_at(self, step: int) -> range | None:
        """The window (a range of 1-based steps) that contains ``step``, or ``None``."""
        if step < 1 or (self.total_steps is not None and step > self.total_steps):
            return None
        start = 1 + (step - 1) // self.every * self.every if self.every else 1
        end = start + self.window
        if self.total_steps is not None:
            end = min(end, self.total_steps + 1)
        return range(start, end) if start <= step < end and end - start >= 2 else None

    def ranges(self) -> list[range]:
        """Every window of the run, in order (needs ``total_steps``)."""
        if self.total_steps is None:
            raise ValueError("the windows of a run of unknown length cannot be listed: pass total_steps")
        starts = range(1, self.total_steps + 1, self.every) if self.every else [1]
        return [w for w in map(self.window_at, starts) if w is not None]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

