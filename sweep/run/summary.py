"""The summary figures of one run (quantiles, ratios, loss, calibration drift) and its CSV rows.

Quantiles are over finite pre-clip norms; skipped steps are counted, not mixed in. With
``clip=calibrated`` they are the first calibration window's (``CalibratedClip.summaries``), and
the clipping ratio is that of the steps after the windows.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from clipamp_engine.calibration import REPORTED_QUANTILES, CalibrationSummary, quantiles

from sweep.config.schema import Config
from sweep.run.loop import RunRecords


def window_metrics(summary: CalibrationSummary, first: CalibrationSummary) -> dict[str, float]:
    """What a closing window logs at its last step: its quantiles, its τ and τ / the first window's τ."""
    out = {f"window_{k}": v for k, v in summary.quantiles.items()}
    out["window_recommended_max_norm"] = summary.recommended_max_norm
    out["window_drift"] = summary.recommended_max_norm / first.recommended_max_norm
    return out


def summary_metrics(cfg: Config, records: RunRecords, windows: list[CalibrationSummary]) -> dict[str, float]:
    """Quantiles over finite pre-clip norms (of the first window, or of the whole run), ratios, loss."""
    if windows:
        q, tau = windows[0].quantiles, windows[0].recommended_max_norm
        after = [r for r in records.taken() if r["phase"] in ("validate", "train")]  # every step after the window
        clip_ratio = sum(bool(r["clipped"]) for r in after) / len(after) if after else math.nan
    else:
        norms = [r["grad_l2_pre_clip"] for r in records.taken() if math.isfinite(r["grad_l2_pre_clip"])]
        values = quantiles(norms, list(REPORTED_QUANTILES) + [cfg.calibrate.quantile])
        q = {f"p{x * 100:g}": v for x, v in zip(REPORTED_QUANTILES, values)}
        q["max"] = max(norms) if norms else math.nan
        tau = values[-1]
        clip_ratio = records.clip_ratio()
    metrics = {f"grad_norm_{k}": v for k, v in q.items()}
    metrics.update(recommended_max_norm=tau, clip_ratio=clip_ratio, skip_ratio=records.skip_ratio(),
                   final_loss=records.final_loss(), steps_skipped=float(sum(r["skipped"] for r in records.rows)))
    if windows:
        metrics["window_clip_ratio_at_tau"] = windows[0].candidate_clip_ratios[tau]
        metrics["drift"] = windows[-1].recommended_max_norm / tau
    return metrics


def read_rows(csv_path: Path) -> list[dict[str, Any]]:
    """The rows of a steps CSV with their types back (None for empty cells): a resumed run's records
    for its summary and plots (the engine's state, calibration included, comes from the checkpoint)."""

    def value(v: str) -> Any:
        if v == "":
            return None
        if v in ("True", "False"):
            return v == "True"
        for kind in (int, float):
            try:
                return kind(v)
            except ValueError:
                pass
        return v

    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]
    for row in rows:
        row["skip_reason"] = row["skip_reason"] or ""
        row["lr"] = float(row["lr"])
        for k in ("grad_l2_pre_clip", "grad_l2_post_clip", "loss", "scaler_scale"):
            row[k] = float(row[k]) if row[k] is not None else math.nan
    return rows
