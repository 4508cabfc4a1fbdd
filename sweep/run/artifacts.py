"""What a run records of its config and results: the params as logged, config.yaml, quantiles.json."""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

from clipamp_engine import CalibratedClip
from clipamp_engine.calibration import CalibrationSummary
from sweep.config.convert import as_yaml, flat_params
from sweep.config.schema import Config
from sweep.run.calibration import calibration_payload
from sweep.tracking.tracker import RunTracker, param_text, redact_text


def logged_params(cfg: Config) -> dict[str, str]:
    """The config's params as the run logged them (the values a resume compares against)."""
    return {k: param_text(v) for k, v in flat_params(cfg).items()}


def write_data_artifacts(
    cfg: Config,
    tracker: RunTracker,
    metrics: dict[str, float],
    windows: list[CalibrationSummary],
    calibration: CalibratedClip | None,
) -> None:
    """config.yaml (passwords redacted) and quantiles.json (the summary metrics, every window, the calibration)."""
    tracker.artifact_path("config.yaml").write_text(redact_text(as_yaml(cfg)))
    payload = {"metrics": metrics, "windows": [w.as_dict() for w in windows]}
    if calibration is not None:
        payload["calibration"] = calibration_payload(calibration)
    tracker.artifact_path("quantiles.json").write_text(json_text(payload))


def json_text(payload: Any) -> str:
    """An artifact's JSON: indented, NaN and infinities as ``null`` (a strict parser refuses a bare NaN)."""
    return json.dumps(finite_or_none(payload), indent=2, default=float, allow_nan=False)


def finite_or_none(value: Any) -> Any:
    """``value`` with every NaN or infinite float as ``None`` (JSON has no NaN), through dicts and lists."""
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    if isinstance(value, numbers.Real) and not isinstance(value, int):  # floats, numpy floats
        return float(value) if math.isfinite(value) else None
    return value
