"""The calibration settings of the run that wrote a CSV, from the config it left beside it.

A clipamp app run writes ``steps.csv`` next to ``config.yaml`` (its resolved config, an MLflow artifact);
a Hydra output folder holds ``.hydra/config.yaml``; a trainer integration (``ClipampCallback``,
``ClipampAccelerate``) writes ``steps.clipamp.yaml`` next to its ``steps.csv`` (``sweep.run.csv_settings``:
named after the CSV, so that it never takes a user's file's name), with the run's length as its
calibration knew it (``total_steps``). Their ``calibrate`` section is what the run calibrated with,
read as the run's ``calibrate.*`` params are (``run_settings``), so that ``python -m sweep.recommend
steps.csv`` and ``runs:/ID`` of one run give the same τ, and an integration's CSV the τ it printed.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import yaml

from sweep.recommend.replay import run_settings
from sweep.run.csv_settings import SETTINGS_NAME, lengths_from_tags

#: Where, relative to the CSV's folder, a run's config is looked for, in order (``{stem}``: the CSV's
#: name without its suffix): the integration's settings named after the CSV first, as the most specific.
CONFIG_NAMES = (SETTINGS_NAME, "config.yaml", ".hydra/config.yaml")


def config_names(csv_path: Path) -> list[str]:
    """``CONFIG_NAMES`` for ``csv_path``: ``steps.clipamp.yaml``, ``config.yaml``, ``.hydra/config.yaml``."""
    return [name.format(stem=Path(csv_path).stem) for name in CONFIG_NAMES]


def csv_run_params(csv_path: Path) -> tuple[dict[str, str], Path | None]:
    """The first config beside ``csv_path`` with a ``calibrate`` section as the params its run logged (``run``,
    ``clip.mode``, ``calibrate.*``, and ``total_steps`` where it says: an app config's ``steps``), and that
    config's path; ``({}, None)`` when there is none (or it is not readable YAML)."""
    for name in config_names(csv_path):
        path = Path(csv_path).parent / name
        try:
            cfg = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        section = cfg.get("calibrate") if isinstance(cfg, dict) else None
        if isinstance(section, dict):
            clip = cfg.get("clip") if isinstance(cfg.get("clip"), dict) else {}
            params = {"run": str(cfg.get("run")), "clip.mode": str(clip.get("mode"))}
            length = cfg["total_steps"] if "total_steps" in cfg else cfg.get("steps")  # an integration's, an app run's
            params |= {"total_steps": str(length)} if "total_steps" in cfg or isinstance(length, int) else {}
            params |= {"earlier_lengths": str(cfg["earlier_lengths"])} if "earlier_lengths" in cfg else {}
            return {**params, **{f"calibrate.{k}": str(v) for k, v in section.items()}}, path
    return {}, None


def csv_run(csv_path: Path, ours: bool) -> dict[str, Any]:
    """The ``NormSeries`` fields the config beside ``csv_path`` gives: ``settings`` (with a note where they are
    not the run's choice), ``settings_from``, and the run's length where it says (``total_steps``, or
    ``open_ended`` where its calibration knew none); for a clipamp CSV (``ours``) without one, a note that
    the settings are this command's defaults."""
    params, config = csv_run_params(csv_path)
    if config is None:
        return {"settings": {}, "notes": [no_config_note(csv_path)] if ours else [], "settings_from": None}
    settings, notes = own_settings(params, f"the run of {config}")
    out = {"settings": settings, "notes": notes, "settings_from": f"the run's config {config} (calibrate.*)"}
    return out | (run_length(params, notes, f"{config}: total_steps: null") if settings else {})


def _earlier(entries: Any) -> list[tuple[int, int | None]]:
    """A settings file's ``earlier_lengths`` as ``(through_step, total_steps)`` pairs; an entry of another shape
    is left out."""
    out = []
    for e in entries if isinstance(entries, list) else []:
        step, total = (e.get("through_step"), e.get("total_steps")) if isinstance(e, dict) else (None, None)
        if isinstance(step, int) and step > 0 and (total is None or isinstance(total, int) and total > 0):
            out.append((step, total))
    return out


def _literal(text: str | None) -> Any:
    try:
        return ast.literal_eval(text) if text else None
    except (ValueError, SyntaxError):
        return None


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def run_params(params: dict[str, str], tags: dict[str, str]) -> dict[str, str]:
    """A run's MLflow params with its length as ``run_length`` reads it: an app run's ``steps`` as ``total_steps``,
    an integration's as a resume that changed it left it in the run's tags (``sweep.run.csv_settings.LENGTH_TAGS``:
    its param ``total_steps`` is the length it started with)."""
    app = {"total_steps": params["steps"]} if "total_steps" not in params and "steps" in params else {}
    return params | app | lengths_from_tags(tags)


def run_length(params: dict[str, str], notes: list[str], where: str) -> dict[str, Any]:
    """The run's length as its calibration knew it, from an integration's ``total_steps`` (its settings file's, or
    its MLflow run's param): ``{"total_steps": N}`` (the live run placed its window for N steps, a log cut short
    too), ``{"open_ended": True}`` with a note in ``notes`` (it knew none: neither does the replay), or ``{}``;
    with ``earlier_lengths`` where a resume changed it (the steps calibrated for each earlier length)."""
    length, out = params.get("total_steps"), {}
    earlier = _earlier(_literal(params.get("earlier_lengths")))
    if earlier:
        out["earlier_lengths"] = earlier
        firsts, lengths = [1, *(step + 1 for step, _ in earlier)], [n for _, n in earlier] + [_int(length)]
        ends = [f"–{step}" for step, _ in earlier] + [" on"]
        parts = [
            f"{f'a run of {n} steps' if n else 'no run length'} at steps {a}{b}"
            for a, b, n in zip(firsts, ends, lengths)
        ]
        notes.append(
            f"the run was resumed with another length: its calibration knew {'; '.join(parts)} (earlier_lengths), "
            "and is replayed so"
        )
    if length == "None":
        notes.append(f"the run's length was unknown to its calibration ({where}): none assumed")
        return out | {"open_ended": True}
    if length is not None and length.isdigit() and int(length) > 0:
        return out | {"total_steps": int(length)}
    return out


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
    *first, last = config_names(csv_path)
    return (
        f"no run config ({', '.join(first)} or {last}) beside {csv_path.name}: the calibration settings are "
        "this command's defaults and options, not necessarily the run's; pass the run's calibrate.* as options "
        "(--window W --start S …) or read its MLflow run (runs:/ID), which carries them"
    )
