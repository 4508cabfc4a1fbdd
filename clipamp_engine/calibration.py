"""Norm calibration windows: measure pre-clip norms for a while, then pick τ from their quantiles.

A calibration window is a short training interval used to estimate typical gradient-norm
percentiles before fixing (or revising) the clipping threshold; τ = Quantile_q of the window's
finite pre-clip norms clips only the spikes (q = 0.95 by default). Skipped steps are counted,
never mixed into the quantiles. Quantiles use linear interpolation in float64, i.e. exactly
``numpy.quantile``'s default.

Each quantile comes with a distribution-free confidence interval between two order statistics
(``quantile_ci``): with B ~ Binomial(n, q) the number of norms at or below the true quantile,
P(X_(r) ≤ ξ_q ≤ X_(s)) = P(r ≤ B ≤ s − 1), so r and s are read off the binomial CDF. It
assumes only that the window's norms are independent draws from one continuous distribution
(a stationary stretch of training); it says nothing about drift, which ``every``
windows measure.

References:
    Pascanu, Mikolov, Bengio, "On the difficulty of training recurrent neural networks", ICML 2013
        (the threshold from the statistics of the norms over many updates).
    Seetharaman et al., "AutoClip", arXiv:2007.14469 (percentile-based thresholds).
    Conover, "Practical Nonparametric Statistics", 3rd ed. (1999), §3.2 (confidence interval
    for a quantile); Hahn & Meeker, "Statistical Intervals" (1991), ch. 5 (distribution-free
    intervals and the sample size they need).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .checks import check_calibrator_options
from .records import StepLog
from .spelling import ENGINE, Spelling
from .windows import DEFAULT_WINDOW as DEFAULT_WINDOW  # re-exported: imported from here too
from .windows import CalibrationWindows as CalibrationWindows

REPORTED_QUANTILES = (0.5, 0.9, 0.95, 0.99)
CONFIDENCE = 0.95
#: A window's defaults, written only here (steps per window: ``clipamp_engine.windows``): q of τ = Quantile_q, and
#: the fixed thresholds whose clipping ratio a summary reports (``NormCalibrator``, ``CalibratedClip``; the app's
#: ``calibrate.*`` and the recommend CLI read them from these).
DEFAULT_QUANTILE = 0.95
DEFAULT_CANDIDATES = (0.5, 1.0, 2.0, 5.0)


def quantile_label(q: float) -> str:
    """The name of Quantile_q: ``p95`` for 0.95, ``p97.5`` for 0.975, ``p99.9`` for 0.999 (float noise
    such as 0.07 · 100 = 7.000000000000001 dropped). Summaries key their quantiles and intervals by
    it; the app's metrics are ``grad_norm_<label>``."""
    return f"p{q * 100:.10g}"


#: The reported quantiles' names: p50, p90, p95, p99.
QUANTILE_KEYS = tuple(quantile_label(q) for q in REPORTED_QUANTILES)


class CalibrationError(ValueError):
    """A calibration window cannot recommend a threshold (e.g. every step of it was skipped)."""


def quantiles(values: Sequence[float], qs: Iterable[float]) -> list[float]:
    """Linear-interpolation quantiles (numpy's default) of ``values``; NaN for an empty set."""
    qs = list(qs)
    if not values:
        return [math.nan] * len(qs)
    data = torch.tensor(list(values), dtype=torch.float64)
    return torch.quantile(data, torch.tensor(qs, dtype=torch.float64)).tolist()


def _binomial_cdf(n: int, q: float) -> torch.Tensor:
    """P(B ≤ k) for k = 0..n, B ~ Binomial(n, q), in float64."""
    k = torch.arange(n + 1, dtype=torch.float64)
    dist = torch.distributions.Binomial(
        total_count=torch.tensor(float(n), dtype=torch.float64), probs=torch.tensor(q, dtype=torch.float64)
    )
    return dist.log_prob(k).exp().cumsum(0).clamp(max=1.0)


def order_statistic_ranks(n: int, q: float, confidence: float = CONFIDENCE) -> tuple[int | None, int | None, float]:
    """1-based ranks (r, s) of the order statistics bounding Quantile_q with ``confidence``, and the
    exact coverage P(r ≤ B ≤ s − 1) they achieve (≥ ``confidence`` whenever both exist).

    r is the largest rank with P(B ≤ r − 1) ≤ α/2, s the smallest with P(B ≤ s − 1) ≥ 1 − α/2
    (Conover 1999, §3.2). A rank that would fall outside 1..n is ``None``: the window is too short
    to bound the quantile on that side; the coverage then counts that side as unbounded.
    """
    if n < 1:
        return None, None, 0.0
    half = (1.0 - confidence) / 2
    cdf = _binomial_cdf(n, q)
    low = int((cdf <= half).sum())  # = r: the ks with F(k) ≤ α/2 are 0..r-1
    r = low if low >= 1 else None
    s_minus_1 = int((cdf < 1.0 - half).sum())  # smallest k with F(k) ≥ 1 - α/2
    s = s_minus_1 + 1 if s_minus_1 + 1 <= n else None
    below = float(cdf[r - 1]) if r is not None else 0.0
    above = float(cdf[s - 1]) if s is not None else 1.0
    return r, s, above - below


def min_window(q: float, confidence: float = CONFIDENCE) -> int:
    """The fewest norms for which both bounds of Quantile_q's interval exist.

    The upper bound needs P(B ≤ n − 1) = 1 − qⁿ ≥ 1 − α/2, the lower one (1 − q)ⁿ ≤ α/2
    (Hahn & Meeker 1991, §5.2): n ≥ log(α/2) / log(max(q, 1 − q)). For a 95% interval that is
    6 norms for p50, 36 for p90, 72 for p95 and 368 for p99.
    """
    half = (1.0 - confidence) / 2
    return math.ceil(math.log(half) / math.log(max(q, 1.0 - q)) - 1e-12)


def window_for_width(n: int, rel_width: float, target: float, minimum: int | None = None) -> int | None:
    """Window length for a relative interval width ``target``, extrapolated from ``n`` norms.

    An order-statistic interval's width shrinks like 1/√n (its ranks sit ±z·√(n q (1−q)) around
    q·n, and the width is that rank spread over the density at ξ_q), so
    n_needed ≈ n · (rel_width / target)². An estimate from one window: it assumes the norms stay
    stationary while the window grows. ``None`` when the current width is unknown (unbounded).
    ``minimum``: the shortest answer (default ``n``: a window already narrow enough needs no more;
    1 extrapolates down to a shorter window too).
    """
    if not (math.isfinite(rel_width) and target > 0):
        return None
    return max(n if minimum is None else minimum, math.ceil(n * (rel_width / target) ** 2))


@dataclass(frozen=True)
class QuantileCI:
    """Quantile_q of a window with its distribution-free confidence interval.

    ``low``/``high`` are NaN when the window is too short to bound that side (``bounded`` false).
    """

    q: float
    estimate: float
    low: float
    high: float
    confidence: float
    n: int
    coverage: float  # exact binomial coverage of [low, high] (≥ confidence when bounded)

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)

    @property
    def rel_width(self) -> float:
        """(high − low) / estimate; NaN when unbounded."""
        return (self.high - self.low) / self.estimate if self.bounded and self.estimate > 0 else math.nan

    def overlaps(self, other: QuantileCI) -> bool:
        """Whether the two intervals share a point (an unbounded side reaches to ±∞)."""
        lo_a = self.low if math.isfinite(self.low) else -math.inf
        hi_a = self.high if math.isfinite(self.high) else math.inf
        lo_b = other.low if math.isfinite(other.low) else -math.inf
        hi_b = other.high if math.isfinite(other.high) else math.inf
        return lo_a <= hi_b and lo_b <= hi_a

    def as_dict(self) -> dict:
        """Plain values; a missing bound (and so the width) is ``None`` (JSON null), never NaN."""

        def value(x: float) -> float | None:
            return x if math.isfinite(x) else None

        return {
            "q": self.q,
            "estimate": self.estimate,
            "low": value(self.low),
            "high": value(self.high),
            "confidence": self.confidence,
            "n": self.n,
            "coverage": self.coverage,
            "rel_width": value(self.rel_width),
            "min_window": min_window(self.q, self.confidence),
        }


def quantile_ci(values: Sequence[float], q: float, confidence: float = CONFIDENCE) -> QuantileCI:
    """Quantile_q of ``values`` (numpy's linear interpolation) and its order-statistic interval."""
    if not 0.0 < q < 1.0 or not 0.0 < confidence < 1.0:
        raise ValueError(f"q={q!r} and confidence={confidence!r} must both be in (0, 1)")
    n = len(values)
    r, s, coverage = order_statistic_ranks(n, q, confidence)
    ordered = sorted(values)
    estimate = quantiles(values, [q])[0]
    low = ordered[r - 1] if r is not None else math.nan
    high = ordered[s - 1] if s is not None else math.nan
    return QuantileCI(q, estimate, low, high, confidence, n, coverage)


def short_window_warning(ci: QuantileCI, steps_per_norm: float = 1.0, spelling: Spelling = ENGINE) -> str | None:
    """One line when the window cannot bound Quantile_q, else None. The window it needs is said in steps
    (the ``window`` option's unit) at ``steps_per_norm``, the window's steps per finite norm (above 1 with
    skipped steps or a log sampled every N steps); the options it names, as ``spelling`` writes them."""
    if ci.bounded:
        return None
    need = min_window(ci.q, ci.confidence)
    steps = math.ceil(need * max(1.0, steps_per_norm) - 1e-9)
    return (
        f"{quantile_label(ci.q)} from {ci.n} norms has no {ci.confidence:.0%} "
        f"{'upper' if math.isnan(ci.high) else 'lower'} confidence bound (it needs ≥ {need} norms); "
        f"{'it is essentially the window maximum' if ci.q > 0.5 else 'it is essentially the window minimum'}: "
        f"lengthen {spelling.name('window')} to ≥ {steps} steps or use a lower {spelling.name('quantile')}"
    )


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
    cis: dict[str, QuantileCI] = field(default_factory=dict)  # "p50".."p99" and the chosen q's label
    notes: list[dict[str, Any]] = field(default_factory=list)  # each warning as a code and its figures (kept)
    spelling: Spelling = field(default=ENGINE, compare=False, repr=False)  # how ``warnings`` names the options

    @property
    def warnings(self) -> list[str]:
        """Each note rendered with ``spelling``: ``short_window`` (``short_window_warning`` of τ's interval at the
        window's steps per norm), or a text a state kept rendered (``text``)."""
        return [
            n["text"] if n["code"] == "text" else short_window_warning(self.tau_ci, n["steps_per_norm"], self.spelling)
            for n in self.notes
        ]

    @property
    def tau_ci(self) -> QuantileCI:
        """The interval of the recommended τ (= Quantile_q of the window)."""
        return self.cis[quantile_label(self.quantile)]

    @property
    def predicted_clip_ratio(self) -> float:
        """The share of the window's norms above τ: what clipping at τ should do on like steps."""
        return self.candidate_clip_ratios[self.recommended_max_norm]

    def as_dict(self) -> dict:
        return {
            "start_step": self.start_step,
            "end_step": self.end_step,
            "n_finite": self.n_finite,
            "n_skipped": self.n_skipped,
            "quantiles": self.quantiles,
            "token_normalised_quantiles": self.token_quantiles,
            "confidence_intervals": {k: ci.as_dict() for k, ci in self.cis.items()},
            "quantile": self.quantile,
            "recommended_max_norm": self.recommended_max_norm,
            "predicted_clip_ratio": self.predicted_clip_ratio,
            "candidate_clip_ratios": {f"{k:g}": v for k, v in self.candidate_clip_ratios.items()},
            "warnings": list(self.warnings),
        }

    def as_state(self) -> dict[str, Any]:
        """Plain values for a checkpoint, the warnings as their notes (never rendered);
        ``CalibrationSummary.from_state(state)`` restores it exactly."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "spelling"}

    @classmethod
    def from_state(cls, state: dict[str, Any], spelling: Spelling = ENGINE) -> CalibrationSummary:
        """``as_state``'s summary, its warnings rendered with ``spelling``; a state that kept them rendered
        (``"warnings"``: texts) shows those texts."""
        state = {**state, "cis": {k: QuantileCI(**v) for k, v in state.get("cis", {}).items()}}
        texts = state.pop("warnings", None) or []
        state.setdefault("notes", [{"code": "text", "text": t} for t in texts])
        return cls(**state, spelling=spelling)


class NormCalibrator:
    """Collects the pre-clip norms of one window and summarises them.

    Args:
        quantile: q for the recommendation τ = Quantile_q (0 < q < 1).
        candidates: fixed thresholds whose would-be clipping ratio is reported too (any order, none twice;
            ``[]``: none beside the quantiles and τ).
        confidence: level of the quantiles' order-statistic intervals.
        spelling: how the summary's warning names the options (``clipamp_engine.spelling``).
    """

    def __init__(
        self,
        quantile: float = DEFAULT_QUANTILE,
        candidates: Sequence[float] = DEFAULT_CANDIDATES,
        confidence: float = CONFIDENCE,
        *,
        spelling: Spelling = ENGINE,
    ) -> None:
        check_calibrator_options(quantile, candidates, confidence)
        self.spelling = spelling
        self.quantile = quantile
        self.confidence = confidence
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
        return {
            "norms": list(self.norms),
            "token_norms": list(self.token_norms),
            "steps": list(self.steps),
            "n_skipped": self.n_skipped,
        }

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
                f"{self.steps[-1] if self.steps else '?'}) has no finite norm: every step was skipped"
            )
        qs = list(REPORTED_QUANTILES)
        values = quantiles(self.norms, qs + [self.quantile])
        named = {quantile_label(q): v for q, v in zip(qs, values)}
        named["max"] = max(self.norms)
        tok = {}
        if self.token_norms:
            tok = {quantile_label(q): v for q, v in zip(qs, quantiles(self.token_norms, qs))}
            tok["max"] = max(self.token_norms)
        tau = values[-1]
        thresholds = sorted({*self.candidates, *(named[quantile_label(q)] for q in qs), tau})
        cis = {
            quantile_label(q): quantile_ci(self.norms, q, self.confidence) for q in dict.fromkeys(qs + [self.quantile])
        }
        first, last, k = self.steps[0], self.steps[-1], len(self.steps)  # a sampled log: its interval × k steps
        span = (last - first) / (k - 1) * k if k > 1 else k
        short = not cis[quantile_label(self.quantile)].bounded
        return CalibrationSummary(
            start_step=self.steps[0],
            end_step=self.steps[-1],
            n_finite=len(self.norms),
            n_skipped=self.n_skipped,
            quantiles=named,
            token_quantiles=tok,
            quantile=self.quantile,
            recommended_max_norm=tau,
            candidate_clip_ratios={t: self.clip_ratio_at(t) for t in thresholds},
            cis=cis,
            notes=[{"code": "short_window", "steps_per_norm": span / len(self.norms)}] if short else [],
            spelling=self.spelling,
        )
