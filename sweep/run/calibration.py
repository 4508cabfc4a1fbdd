"""What a calibrate run's ``CalibratedClip`` did, as data: MLflow metrics and ``quantiles.json``.

The engine runs the windows (placement, quantiles with intervals, the adopted τ, its check on the
held-out steps, drift; see ``clipamp_engine.clip.calibrated``); the report renders the same
object for people (``sweep.report.calibration``).
"""

from __future__ import annotations

import math
from typing import Any

from clipamp_engine.clip import CalibratedClip


def calibration_payload(clip: CalibratedClip) -> dict[str, Any]:
    """Placement, every window (intervals, drift, band check), as plain values (None, never NaN)."""
    return {
        "placement": {**clip.placement.as_dict(), "reason": clip.placement.reason} if clip.placement else None,
        "quantile": clip.quantile,
        "target_clip": list(clip.band),
        "validate": clip.validate,
        "windows": [
            {**s.as_dict(), "drift_from_previous": d, "band_check": c.as_dict() if c else None}
            for s, d, c in zip(clip.summaries, clip.drift(), clip.checks())
        ],
    }


def calibration_metrics(clip: CalibratedClip) -> dict[str, float]:
    """The quantile τ is, placement, the first window's intervals, its prediction and check, the drift count."""
    out: dict[str, float] = {"tau_quantile": clip.quantile}  # q of τ = Quantile_q (calibrate.quantile=null: the band's)
    if clip.placement is not None:
        out["window_start"] = float(clip.placement.start)
        if clip.placement.warmup_end is not None:
            out["warmup_end"] = float(clip.placement.warmup_end)
    if not clip.summaries:
        return out
    first = clip.summaries[0]
    for k, ci in first.cis.items():
        if math.isfinite(ci.low):
            out[f"grad_norm_{k}_ci_low"] = ci.low
        if math.isfinite(ci.high):
            out[f"grad_norm_{k}_ci_high"] = ci.high
    out["predicted_clip_ratio"] = first.predicted_clip_ratio
    check = clip.checks()[0]
    if check is not None:
        out.update(
            validation_clip_ratio=check.realised,
            validation_steps=float(check.steps),
            validation_in_band=float(check.inside),
            validation_consistent=float(check.consistent),
            validation_within_2x=float(check.within_2x),
        )
        if check.predicted > 0:
            out["realised_over_predicted"] = check.factor
    out["drift_windows"] = float(sum(clip.drift()))
    return out
