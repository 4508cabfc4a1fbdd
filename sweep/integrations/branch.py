"""Which MLflow run a host's resume records in: the checkpoint's own, or a new one that branches from it.

MLflow cannot remove a metric point. A run that holds no step past the checkpoint resumed from (a run killed
after its latest checkpoint: the steps after it were held, ``RunTracker.hold_after``) is reopened, and the
resume adds the steps it trains. A run that does hold later steps (it finished, or it was killed after a
later checkpoint than the one resumed from) would keep its first values of those steps beside the resume's:
the resume records in a new run instead, in the same experiment, tagged ``resumed.from_run`` (the run it
continues) and ``resumed.from_step`` (the checkpoint's step), that holds that run's metric values up to the
checkpoint's step (in step order) and its ``steps.csv`` rows 1..step, then the resume's steps. The first run
is left as it was. Either way the run's history equals its ``steps.csv``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

#: The tags of a run that continues another from one of its checkpoints: that run's id, the checkpoint's step.
FROM_RUN, FROM_STEP = "resumed.from_run", "resumed.from_step"


def continue_run(store, run, step: int, csv: str | None, *, parent: str | None, name: str, tags, params):
    """``(tracker, note, lost)``: ``run`` (an MLflow ``Run``) reopened when it holds no metric value after ``step``
    (``note`` ``None``); else a new run that branches from it at ``step`` (``note``: the line that says so; ``lost``:
    why its rows 1..step could not be copied (``csv``, the checkpoint's ``steps.csv``, gone), else ``None``)."""
    from ..tracking.tracker import RunTracker

    client, run_id = store.client, run.info.run_id
    history = [m for key in run.data.metrics for m in client.get_metric_history(run_id, key)]
    last = max((m.step for m in history), default=0)
    if last <= step:
        return RunTracker.reopen(client, run_id, upto=step), None, None
    tracker = RunTracker(
        client,
        run.info.experiment_id,
        name,
        tags={**tags, FROM_RUN: run_id, FROM_STEP: str(step)},
        parent_run_id=parent,
    )
    try:
        tracker.log_params(params)
        lost = _copy_csv(client, run_id, csv, tracker.artifact_path("steps.csv"))
        if lost is None:  # the rows are there: their metric values too, as the first run logged them
            tracker.copy_metrics(sorted((m for m in history if m.step <= step), key=lambda m: (m.step, m.timestamp)))
    except BaseException:  # the store or a signal cut the copy short: the new run must not stay RUNNING
        tracker.end("FAILED")
        raise
    note = (
        f"MLflow run {run_id} holds steps up to {last}, past the checkpoint's step {step}, and MLflow cannot remove "
        f"them: the resume records in a new run {tracker.run_id} (tags {FROM_RUN}, {FROM_STEP})"
        + ("" if lost else f" that begins with that run's steps 1–{step}")
    )
    return tracker, note, lost


def _copy_csv(client, run_id: str, csv: str | None, dst: Path) -> str | None:
    """Copy the first run's ``steps.csv`` to ``dst``: the checkpoint's (``csv``), else the one the run uploaded
    (a remote store); why neither can be, else ``None``."""
    if csv is not None and Path(csv).exists():
        shutil.copyfile(csv, dst)
        return None
    with tempfile.TemporaryDirectory() as folder, contextlib.suppress(Exception):  # none uploaded: said below
        shutil.copyfile(client.download_artifacts(run_id, "steps.csv", folder), dst)
        return None
    return f"{csv} is missing" if csv is not None else f"MLflow run {run_id} holds no steps.csv"
