"""The calibration settings of the run that wrote a CSV, from the config it left beside it.

A clipamp app run writes ``steps.csv`` next to ``config.yaml`` (its resolved config, an MLflow artifact);
a Hydra output folder holds ``.hydra/config.yaml``. Their ``calibrate`` section is what the run
calibrated with, read as the run's ``calibrate.*`` params are (``run_settings``), so that
``python -m sweep.recommend steps.csv`` and ``runs:/ID`` of one run give the same τ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sweep.recommend.replay import run_settings

#: Where, relative to the CSV's folder, a run's config is looked for, in order.
CONFIG_NAMES = ("config.yaml", ".hydra/config.yaml")


def csv_run_params(csv_path: Path) -> tuple[dict[str, str], Path | None]:
    """The first config beside ``csv_path`` with a ``calibrate`` section as the params its run logged (``run``,
    ``clip.mode``, ``calibrate.*``), and that config's path; ``({}, None)`` when there is none (or it is not
    readable YAML)."""
    for name in CONFIG_NAMES:
        path = Path(csv_path).parent / name
        try:
            cfg = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        section = cfg.get("calibrate") if isinstance(cfg, dict) else None
        if isinstance(section, dict):
            clip = cfg.get("clip") if isinstance(cfg.get("clip"), dict) else {}
            params = {"run": str(cfg.get("run")), "clip.mode": str(clip.get("mode"))}
            return {**params, **{f"calibrate.{k}": str(v) for k, v in section.items()}}, path
    return {}, None


def own_settings(params: dict[str, str], where: str) -> tuple[dict[str, Any], list[str]]:
    """The ``calibrate.*`` settings of a run that calibrated (``run_settings``), and a note where ``params``
    (an MLflow run's, or a config's) say it did not: an app run with another ``clip.mode`` than calibrated,
    not a calibrate run, logs ``calibrate.*`` too, the unused defaults of ``clip=calibrated`` (a 100-step p95
    window from step 1, warm-up included), which are not the run's choice; this command's defaults are."""
    mode = params.get("clip.mode")
    if mode not in (None, "None", "calibrated") and params.get("run") != "calibrate":
        return {}, [
            f"{where} clipped with clip.mode={mode}, not calibrated: its calibrate.* are unused defaults, not "
            "read; the calibration settings are this command's defaults and options"
        ]
    return run_settings(params), []


def no_config_note(csv_path: Path) -> str:
    """Said of a clipamp CSV with no run config beside it: whose calibration settings the report uses."""
    return (
        f"no run config ({' or '.join(CONFIG_NAMES)}) beside {csv_path.name}: the calibration settings are "
        "this command's defaults and options, not necessarily the run's; pass the run's calibrate.* as options "
        "(--window W --start S …) or read its MLflow run (runs:/ID), which carries them"
    )
