"""The summary figures of one run (quantiles, ratios, loss, calibration drift) and its CSV rows.

Quantiles are over finite pre-clip norms; skipped steps are counted, not mixed in. With
``clip=calibrated`` they are the first calibration window's (``CalibratedClip.summaries``), and
the clipping ratio is that of every taken step after the first window (a later window's steps
included: they clip at the τ in force).
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from clipamp_engine.band import PRETRAINING_BAND, band_quantile
from clipamp_engine.calibration import QUANTILE_KEYS, REPORTED_QUANTILES, CalibrationSummary, quantiles
from sweep.config.schema import Config
from sweep.run.loop import RunRecords


def window_metrics(summary: CalibrationSummary, first: CalibrationSummary) -> dict[str, float]:
    """What a closing window logs at its last step: its quantiles, its τ and τ / the first window's τ."""
    out = {f"window_{k}": v for k, v in summary.quantiles.items()}
    out["window_recommended_max_norm"] = summary.recommended_max_norm
    ci = summary.tau_ci  # its interval, where the window bounds it
    out.update({f"window_tau_ci_{side}": v for side, v in (("low", ci.low), ("high", ci.high)) if math.isfinite(v)})
    out["window_drift"] = summary.recommended_max_norm / first.recommended_max_norm
    return out


def summary_metrics(cfg: Config, records: RunRecords, windows: list[CalibrationSummary]) -> dict[str, float]:
    """Quantiles over finite pre-clip norms (of the first window, or of the whole run), ratios, loss."""
    if windows:
        q, tau = windows[0].quantiles, windows[0].recommended_max_norm
        after = [r for r in records.taken() if r["step"] > windows[0].end_step]  # every step after the first window
        clip_ratio = sum(bool(r["clipped"]) for r in after) / len(after) if after else math.nan
    else:
        norms = [r["grad_l2_pre_clip"] for r in records.taken() if math.isfinite(r["grad_l2_pre_clip"])]
        q_tau = cfg.calibrate.quantile  # null: the quantile aimed at the middle of the band
        q_tau = q_tau if q_tau is not None else band_quantile(getattr(cfg.calibrate, "target_clip", PRETRAINING_BAND))
        values = quantiles(norms, list(REPORTED_QUANTILES) + [q_tau])
        q = dict(zip(QUANTILE_KEYS, values))
        q["max"] = max(norms) if norms else math.nan
        tau = values[-1]
        clip_ratio = records.clip_ratio()
    metrics = {f"grad_norm_{k}": v for k, v in q.items()}
    metrics.update(
        recommended_max_norm=tau,
        clip_ratio=clip_ratio,
        skip_ratio=records.skip_ratio(),
        final_loss=records.final_loss(),
        steps_skipped=float(sum(r["skipped"] for r in records.rows)),
    )
    if windows:
        metrics["window_clip_ratio_at_tau"] = windows[0].candidate_clip_ratios[tau]
        metrics["drift"] = windows[-1].recommended_max_norm / tau
    return metrics


def _taus(values: list[float | None]) -> str:
    """``none``, one τ, or the range ``lo–hi`` (``none/lo–hi`` when part of the steps were not clipped)."""
    finite = sorted({v for v in values if v is not None and math.isfinite(v)})
    text = "" if not finite else f"{finite[0]:.4g}" if len(finite) == 1 else f"{finite[0]:.4g}–{finite[-1]:.4g}"
    return "/".join(filter(None, ["none" if None in values else "", text]))


def tau_tags(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The τ a run clipped at, per phase (``tau.<phase>``: from the steps' ``max_norm``, skipped steps
    included) and condensed (``tau_used``: the phases' values in order, repeats merged, e.g. ``none → 2.46``).
    A row without a phase (a step hook's raw record, e.g. a pruned trial's) is a ``train`` step."""
    phases: dict[str, list[float | None]] = {}
    for r in rows:
        v = r["max_norm"]
        phases.setdefault(r.get("phase") or "train", []).append(None if v is None or not math.isfinite(v) else float(v))
    per_phase = {p: _taus(v) for p, v in phases.items()}
    texts = list(per_phase.values())
    condensed = [t for i, t in enumerate(texts) if i == 0 or t != texts[i - 1]]
    return {f"tau.{p}": t for p, t in per_phase.items()} | {"tau_used": " → ".join(condensed)}


def read_rows(csv_path: Path, whole_lines: bool = False) -> list[dict[str, Any]]:
    """The rows of a steps CSV with their types back (None for empty cells): a resumed run's records
    for its summary and plots (the engine's state, calibration included, comes from the checkpoint).
    ``whole_lines``: a last line without its newline (a process killed while writing it) is left out."""

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
        text = f.read()
    if whole_lines:
        text = text[: text.rfind("\n") + 1]
    rows = [{k: value(v) for k, v in row.items()} for row in csv.DictReader(io.StringIO(text, newline=""))]
    for row in rows:
        row["skip_reason"] = row["skip_reason"] or ""
        row["lr"] = float(row["lr"])
        for k in ("grad_l2_pre_clip", "grad_l2_post_clip", "loss", "scaler_scale"):
            row[k] = float(row[k]) if row[k] is not None else math.nan
    return rows
