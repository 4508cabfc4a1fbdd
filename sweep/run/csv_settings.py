"""The calibration settings beside a trainer integration's ``steps.csv``, where no run config sits.

An app run leaves its resolved ``config.yaml`` next to its ``steps.csv``. A trainer integration
(``sweep.integrations.recorder.StepRecorder``: ``ClipampCallback``, ``ClipampAccelerate``) has no
config; it writes ``<csv name>.clipamp.yaml`` next to its CSV instead (``steps.clipamp.yaml``,
in the MLflow run's artifacts or at ``csv_path``): the ``calibrate`` section it calibrated with,
in the config's shape (``run``, ``clip.mode``, ``calibrate.*``), and the run's length as its
calibration knew it (``total_steps``; ``null``: unknown; a run resumed with another length, Trainer's
``max_steps``, also lists ``earlier_lengths``: each ``through_step``, the last step calibrated for a run of
that ``total_steps``), so that ``python -m sweep.recommend steps.csv`` (``sweep.recommend.run_config``)
replays that calibration and gives the τ it printed.

The name comes from the CSV's own, so it is never that of a file a user keeps beside a CSV (a
``config.yaml``, a Hydra ``.hydra/``) and two CSVs in one folder each get their own. The file is
marked (``written_by``): one of that name without the mark is not clipamp's, and is left as it is.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import yaml

#: The settings file's name in the CSV's folder (``stem``: the CSV's name without its suffix).
SETTINGS_NAME = "{stem}.clipamp.yaml"
#: The mark of a settings file clipamp wrote (a file without it is someone else's: never overwritten).
MARK = "clipamp"


def settings_path(csv_path: str | Path) -> Path:
    """Where the settings of ``csv_path``'s run are: ``<stem>.clipamp.yaml`` in the CSV's folder."""
    path = Path(csv_path)
    return path.with_name(SETTINGS_NAME.format(stem=path.stem))


def _plain(value: Any) -> Any:
    """``value`` as YAML's plain types: tuples as lists, numpy scalars as numbers."""
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value.item() if hasattr(value, "item") else value


def write_settings(
    csv_path: str | Path, *, run: str, options: dict[str, Any], lengths: list[list], apply: bool
) -> Path | None:
    """Write the settings of the run recording to ``csv_path`` beside it and return their path; ``None``
    (with a warning) where a file of that name exists that clipamp did not write. ``lengths``: the run's length
    as its calibration knew it, ``[[after_step, total_steps], …]`` (``StepRecorder.lengths``)."""
    path = settings_path(csv_path)
    if path.exists() and not _ours(path):
        warnings.warn(
            f"clipamp: {path} exists and is not clipamp's: left as it is, so `python -m sweep.recommend "
            f"{Path(csv_path).name}` reads this run with its own defaults: pass the run's options there as its "
            "flags (--window, --start, --every, --validate, --quantile)",
            UserWarning,
            stacklevel=3,
        )
        return None
    body = {
        "written_by": MARK,
        "run": run,
        "clip": {"mode": "calibrated", "apply": bool(apply)},  # calibrated: recommended, applied with apply
        "total_steps": _length(lengths[-1][1]),
        "calibrate": {k: _plain(v) for k, v in options.items()},
    }
    if len(lengths) > 1:  # resumed with another length: the last step calibrated for each earlier one
        body["earlier_lengths"] = earlier_lengths(lengths)
    head = (
        f"# The calibration settings of the run that wrote {Path(csv_path).name} (a clipamp trainer integration),\n"
        f"# read by `python -m sweep.recommend {Path(csv_path).name}`; rewritten by each run that writes it.\n"
    )
    path.write_text(head + yaml.safe_dump(body, sort_keys=False), encoding="utf-8")
    return path


def _length(total_steps: int | None) -> int | None:
    return None if total_steps is None else int(total_steps)


def earlier_lengths(lengths: list[list]) -> list[dict[str, int | None]]:
    """``[[after_step, total_steps], …]`` (``StepRecorder.lengths``) as the settings file lists the lengths before
    the last: each ``through_step``, the last step calibrated for a run of that ``total_steps``."""
    ends = [after for after, _ in lengths[1:]]
    return [{"through_step": int(e), "total_steps": _length(n)} for e, (_, n) in zip(ends, lengths)]


#: An integration's or the app's MLflow run whose resume changed its length (its param ``total_steps`` or
#: ``steps`` is the first length, and params cannot change): these tags, read as the params they name, give the
#: lengths as the settings file does.
LENGTH_TAGS = {"resumed.total_steps": "total_steps", "resumed.earlier_lengths": "earlier_lengths"}


def resumed_lengths(saved: list | None, step: int, total_steps: int | None) -> list[list]:
    """The run's length as its calibration knew it, ``[[after_step, total_steps], …]`` (from step ``after_step`` + 1
    on), after a resume at ``step`` for a run of ``total_steps``: the checkpoint's up to ``step`` (a length set after
    it belongs to the steps the resume drops), then ``total_steps`` where it changed (a new ``max_steps``). A
    checkpoint saved without them: the run's length is taken as this one's throughout."""
    kept = [[int(a), n] for a, n in saved or [] if int(a) < step] or [[0, total_steps]]
    return kept if kept[-1][1] == total_steps else [*kept, [step, total_steps]]


def length_tags(lengths: list[list]) -> dict[str, str]:
    """The ``LENGTH_TAGS`` of a run of ``lengths`` (``StepRecorder.lengths``)."""
    return {
        "resumed.total_steps": str(_length(lengths[-1][1])),
        "resumed.earlier_lengths": str(earlier_lengths(lengths)),
    }


def lengths_from_tags(tags: dict[str, str]) -> dict[str, str]:
    """A run's ``LENGTH_TAGS`` as the params they stand for (none: ``{}``)."""
    return {LENGTH_TAGS[k]: v for k, v in tags.items() if k in LENGTH_TAGS}


def _ours(path: Path) -> bool:
    try:
        body = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(body, dict) and body.get("written_by") == MARK
