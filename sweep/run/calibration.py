"""Calibration windows of one run and the run's summary figures (quantiles, ratios, drift).

A window records pre-clip norms (clipping off, or at ``calibrate.cap``); when it closes, τ =
Quantile_q of its finite norms is adopted for the steps that follow (seed lesson 004, "Norm
Calibration Window"). Quantiles are over finite pre-clip norms; skipped steps are counted, not
mixed in.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from clipamp_engine.calibration import REPORTED_QUANTILES, CalibrationSummary, NormCalibrator, quantiles

from sweep.config.schema import Config
from sweep.errors import UserError
from sweep.run.loop import RunRecords


class WindowSchedule:
    """Calibration windows of one run: feed records in, get a summary as each window closes."""

    def __init__(self, cfg: Config, windows: list[range]) -> None:
        self.calibrators = {w.start: NormCalibrator(cfg.calibrate.quantile, cfg.calibrate.candidates) for w in windows}
        self.window_of = {s: w for w in windows for s in w}
        self.summaries: list[CalibrationSummary] = []

    def phase(self, step: int) -> str:
        return "calibrate" if step in self.window_of else "validate"

    def observe(self, log: Any) -> CalibrationSummary | None:
        w = self.window_of.get(log.step)
        if w is None:
            return None
        cal = self.calibrators[w.start]
        cal.add(log)
        if log.step != w[-1]:
            return None
        try:
            summary = cal.summary()
        except ValueError as e:  # every step of the window was skipped
            raise UserError(f"{e}; lengthen calibrate.window, or check amp.dtype and the data") from None
        self.summaries.append(summary)
        return summary


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
        clip_ratio = records.clip_ratio("validate")
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
    """The rows of a steps CSV with their types back (None for empty cells)."""

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
