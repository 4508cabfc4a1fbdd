"""A target clipping band, and the check of a window's τ on held-out steps.

A practical way to choose τ is so that the clipping ratio lands in a small band (large-scale
pretraining: low, often below 5%; a rule of thumb, not a published bound). ``band_quantile`` aims at
the band's midpoint, τ = Quantile_{1 − (low + high)/2} of the window (the realised ratio's sampling
error is binomial, about symmetric in absolute terms, and the band is stated in absolute shares);
``check_band`` then compares the ratio the window predicts (its share of norms above τ) with the
ratio realised while clipping at τ on the following ``calibrate.validate`` steps, with an exact
(Clopper–Pearson) interval on the realised ratio so that a handful of validation steps is not
mistaken for drift.

References:
    Clopper & Pearson, "The use of confidence or fiducial limits illustrated in the case of the
    binomial", Biometrika 26 (1934).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .calibration import CONFIDENCE, _binomial_cdf

#: A healthy clipping ratio for large-scale pretraining: low, often below 5% (a rule of thumb, not a published bound).
PRETRAINING_BAND = (0.01, 0.05)


def validate_band(band: tuple[float, float]) -> tuple[float, float]:
    """``band`` as a (low, high) pair with 0 < low < high < 1, else a ``ValueError`` naming it."""
    try:
        low, high = (float(x) for x in band)
    except (TypeError, ValueError):
        raise ValueError(f"target_clip={band!r} must be two ratios [low, high], e.g. [0.01, 0.05]") from None
    if not 0.0 < low < high < 1.0:
        raise ValueError(f"target_clip=[{low:g}, {high:g}] needs 0 < low < high < 1, e.g. [0.01, 0.05]")
    return low, high


def band_quantile(band: tuple[float, float]) -> float:
    """The quantile whose window clipping ratio is the band's midpoint (low + high) / 2."""
    low, high = validate_band(band)
    return 1.0 - (low + high) / 2


def _binomial_cdf_at(k: int, n: int, p: float) -> float:
    return float(_binomial_cdf(n, p)[k])


def clopper_pearson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Exact two-sided interval for a binomial proportion from ``k`` successes in ``n`` trials."""
    if n < 1:
        return 0.0, 1.0
    half = (1.0 - confidence) / 2

    def solve(f, target: float) -> float:  # f decreasing in p on [0, 1]
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
        return (lo + hi) / 2

    # P(B ≥ k; p_low) = α/2 and P(B ≤ k; p_high) = α/2; P(B ≤ j; p) falls as p grows
    lower = 0.0 if k == 0 else solve(lambda p: _binomial_cdf_at(k - 1, n, p), 1.0 - half)
    upper = 1.0 if k == n else solve(lambda p: _binomial_cdf_at(k, n, p), half)
    return lower, upper


@dataclass(frozen=True)
class BandCheck:
    """Predicted vs realised clipping ratio over the validation steps, with a verdict and the next action."""

    tau: float
    band: tuple[float, float]
    predicted: float  # share of the window's norms above τ
    clipped: int  # validation steps clipped at τ
    steps: int  # validation steps taken (skipped steps are not counted)
    realised: float
    realised_low: float  # Clopper–Pearson interval of the realised ratio
    realised_high: float
    inside: bool  # realised ratio in the band
    consistent: bool  # the predicted ratio lies in the realised ratio's interval (no evidence of drift)
    within_2x: bool  # predicted / 2 ≤ realised ≤ 2 · predicted
    verdict: str
    action: str

    @property
    def factor(self) -> float:
        """realised / predicted (inf when the window predicted no clipping)."""
        return self.realised / self.predicted if self.predicted > 0 else (math.inf if self.realised else 1.0)

    def as_dict(self) -> dict:
        return {**asdict(self), "band": list(self.band), "factor": self.factor}


def check_band(
    tau: float,
    predicted: float,
    clipped: int,
    steps: int,
    band: tuple[float, float],
    confidence: float = CONFIDENCE,
    *,
    repeating: bool = False,
    placed_auto: bool = False,
    held_out_by: str = "steps",
) -> BandCheck:
    """Judge τ on its validation steps: inside the band, or drifted from the prediction (by how much).
    ``repeating``: the run already re-calibrates (``calibrate.every``); ``placed_auto``: the window was placed
    by ``calibrate.start=auto``; ``held_out_by``: what ended its validation steps (``"validate"``: their
    number, ``"every"``: the next window, ``"steps"``: the end of the run). The next action accounts for them."""
    low, high = validate_band(band)
    if steps < 1:
        raise ValueError("no validation step was taken: raise calibrate.validate or steps")
    realised = clipped / steps
    lo, hi = clopper_pearson(clipped, steps, confidence)
    inside = low <= realised <= high
    consistent = lo <= predicted <= hi
    within = predicted / 2 <= realised <= 2 * predicted
    side = "inside" if inside else "above" if realised > high else "below"
    verdict = (
        f"realised {realised:.1%} ({clipped}/{steps} steps, {confidence:.0%} interval {lo:.1%}–{hi:.1%}) "
        f"vs predicted {predicted:.1%}: {side} the band [{low:.0%}, {high:.0%}]; "
    )
    verdict += (
        "consistent with the window"
        if consistent
        else f"drifted: {realised / predicted:.2g}× the prediction"
        if predicted > 0
        else "drifted: the window predicted no clipping"
    )
    return BandCheck(
        tau,
        (low, high),
        predicted,
        clipped,
        steps,
        realised,
        lo,
        hi,
        inside,
        consistent,
        within,
        verdict,
        _action(tau, predicted, realised, steps, (low, high), inside, consistent, repeating, placed_auto, held_out_by),
    )


def _action(
    tau: float,
    predicted: float,
    realised: float,
    steps: int,
    band: tuple[float, float],
    inside: bool,
    consistent: bool,
    repeating: bool = False,
    placed_auto: bool = False,
    held_out_by: str = "steps",
) -> str:
    low, high = band
    if inside:
        return (
            f"keep clip.max_norm={tau:.4g}; re-check when the LR, data mixture or sequence length change "
            f"({'the later windows do' if repeating else 'calibrate.every'})"
        )
    if consistent and low <= predicted <= high:
        need = math.ceil(20 / max(predicted, 1e-9))
        more = {
            "validate": "raise calibrate.validate",
            "every": "space the windows further apart (calibrate.every)",
        }.get(held_out_by, "train longer after the window (raise steps)")
        return (
            f"too few validation steps to tell the ratio from the band ({steps}): {more}; "
            f"≈{need} steps see ~20 clips at {predicted:.1%}"
        )
    if consistent:
        return (
            f"the window itself predicts {predicted:.1%}, outside the band: aim at the band with "
            f"calibrate.quantile=null (τ = Quantile_{band_quantile(band):.3f})"
        )
    if realised > predicted:
        again = (
            "see whether the later windows' τ moved (drift) or the rise was a burst; a longer window"
            if repeating
            else "re-calibrate later or repeatedly (calibrate.every) or with a longer window"
        )
        return (
            f"the norms rose after the window: {again}; clipping that stays above the band after warm-up "
            "points at the LR or loss scale"
        )
    later = (
        "calibrate.start=N, past the step the automatic placement chose"
        if placed_auto
        else "calibrate.start=auto or a larger N"
    )
    return f"the norms fell after the window, which caught a transient: start it later ({later}) or lengthen it"
