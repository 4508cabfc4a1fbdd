"""Where a ``StepRecorder``'s records go, and how they continue when its host resumes from a checkpoint.

``checkpoint_state(recorder)`` is what a host saves with its checkpoint (a ``Trainer``
``checkpoint-N/trainer_state.json``, a Lightning ``.ckpt``): the step, the calibration options,
the policy's state (placement, the open window's norms, every closed window, the validation
counts), the number of windows announced, the ``steps.csv`` and the MLflow run (id and store) the
records went to. It is JSON: non-finite floats and non-string dict keys are encoded (``to_json``)
so that ``from_json`` gives them back exactly.

``resume(recorder, state, …)`` (from ``StepRecorder.begin``) restores the policy, so that the
calibration and, with ``apply=True``, the clip go on as in the run that was never stopped, then
continues the records:

- the same ``steps.csv``: rows 1..step kept, rows past it (written after the checkpoint by the run
  that was stopped) dropped (``StepCSVWriter(truncate_after=step)``), and read back into the
  records, so that the end-of-run summary covers the whole run;
- the same MLflow run (``RunTracker.reopen``) when the checkpoint names one in the store this run
  tracks to; the per-step metrics of rows 1..step that the store lacks are sent: every step once. A run
  that holds steps past the checkpoint (it finished, or went on to a later checkpoint) is left as it was:
  a new run continues it, with its steps up to the checkpoint (``sweep.integrations.branch``).

Where they cannot continue (the CSV or the run is gone, or this run records elsewhere: another
store, CSV only, or MLflow where the checkpoint's run had none) one ``ResumeWarning`` line says
why, and the records start afresh at the next step (a new CSV, a new run); the calibration still
continues from the checkpoint. Calibration options that differ from the checkpoint's are refused
(``ValueError``): its windows were measured under them.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

from clipamp_engine.csvlog import StepCSVWriter

from ..errors import one_line
from ..run.csv_settings import resumed_lengths
from ..run.summary import read_rows
from .branch import continue_run

#: A ``sweep.integrations.recorder.StepRecorder`` (not imported: the recorder imports this module).
Recorder = Any

_FLOAT, _ITEMS = "__float__", "__items__"

#: The experiment of a run that nests under no active run, unless ``experiment=`` names one.
DEFAULT_EXPERIMENT = "clipamp"


class ResumeWarning(UserWarning):
    """A resume whose records cannot continue those of the checkpoint's run (they start afresh)."""


def warn_fresh(step: int, why: str, subject: str = "the checkpoint") -> None:
    """One ``ResumeWarning`` line: the run resumes at ``step`` without the recorder's state (``subject`` ``why``)."""
    warnings.warn(
        f"clipamp: resuming at step {step}: {subject} {why}: the calibration and the records start "
        f"afresh at step {step + 1}",
        ResumeWarning,
        stacklevel=3,
    )


def to_json(value: Any) -> Any:
    """``value`` in plain JSON: a non-finite float as ``{"__float__": "nan"}``, a dict with a non-string key
    or keys out of sorted order as ``{"__items__": [[key, value], …]}`` (so that neither the keys' types nor
    their order depend on how the file is written), tuples as lists, paths as text, numpy scalars as numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT: repr(float(value))}
    if isinstance(value, dict):
        keys = list(value)
        if all(isinstance(k, str) for k in keys) and keys == sorted(keys):  # a JSON file may sort the keys
            return {k: to_json(v) for k, v in value.items()}
        return {_ITEMS: [[to_json(k), to_json(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item"):  # a numpy or 0-d torch scalar
        return to_json(value.item())
    raise TypeError(f"{value!r} ({type(value).__name__}) cannot be saved in a checkpoint's JSON")


def from_json(value: Any) -> Any:
    """The value ``to_json`` encoded (lists stay lists)."""
    if isinstance(value, dict):
        if set(value) == {_FLOAT}:
            return float(value[_FLOAT])
        if set(value) == {_ITEMS}:
            return {from_json(k): from_json(v) for k, v in value[_ITEMS]}
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def checkpoint_state(recorder: Recorder) -> dict[str, Any]:
    """The recorder's state at its last recorded step, as JSON (see the module's docstring)."""
    writer, tracker = recorder.writer, recorder.tracker
    state = {
        "step": recorder.step,
        "options": recorder.calibration_options(),
        "policy": recorder.policy.state_dict(),
        "announced": recorder._announced,
        "csv": str(writer.path.absolute()) if writer is not None else None,
        "run_id": tracker.run_id if tracker is not None else None,
        "tracking_uri": recorder.store_label if tracker is not None else None,
        "lengths": recorder.lengths,
    }
    return to_json(dict(sorted(state.items())))  # keys in order: plain JSON at the top level


def open_store(tracking: str, experiment: str | None):
    """The MLflow store ``tracking`` names (``"auto"``: the active run's, else ``$MLFLOW_TRACKING_URI`` or
    the default sqlite store), the id of the active run to nest under (``"auto"`` only), and the store's
    label: its URI with a relative sqlite path made absolute and passwords hidden (how a checkpoint names it).
    The run goes into ``experiment``; ``None``: the active run's experiment when it nests under one (MLflow's
    UI shows a child under its parent only within one experiment), else ``clipamp``. Only ``clipamp``, and an
    experiment this creates, get the tags that open the MLflow UI on clipamp's columns (``sweep.tracking.ui``):
    one the user named that exists keeps its own, as an active run's does (``Store.beside``)."""
    import mlflow

    from ..secrets import redact
    from ..tracking.store import anchored
    from ..tracking.tracker import Store

    active = mlflow.active_run() if tracking == "auto" else None
    uri = mlflow.get_tracking_uri() if active else None if tracking == "auto" else tracking
    if active and experiment is None:
        store = Store.beside(uri, active.info.experiment_id)
    else:
        store = Store.open(
            uri,
            DEFAULT_EXPERIMENT if experiment is None else experiment,
            retag=experiment in (None, DEFAULT_EXPERIMENT),
        )
    return store, active.info.run_id if active else None, redact(anchored(store.uri, Path.cwd()))


def new_run(store, parent: str | None, name: str, tags: dict[str, str], params: dict[str, Any]):
    """A new MLflow run in ``store`` (a child of ``parent``, if any), its tags and params logged."""
    from ..tracking.tracker import RunTracker

    tracker = RunTracker(store.client, store.experiment_id, name, tags=tags, parent_run_id=parent)
    tracker.log_params(params)
    return tracker


def resume(
    recorder: Recorder,
    saved: dict[str, Any],
    *,
    path: Path,
    main_process: bool,
    run_name: str,
    tags: dict[str, str],
    params: dict[str, Any],
) -> None:
    """Restore the policy from ``saved`` (``checkpoint_state``) and, on the main process, continue its
    records (``path``: the CSV to start when there is no MLflow run and the checkpoint names no CSV)."""
    state = from_json(saved)
    step, theirs = int(state["step"]), {k: to_json(v) for k, v in state["options"].items()}
    ours = {k: to_json(v) for k, v in recorder.calibration_options().items()}
    changed = [f"{k}={theirs.get(k)!r} there, {k}={v!r} here" for k, v in ours.items() if theirs.get(k) != v]
    if changed:
        raise ValueError(
            f"the checkpoint at step {step} was calibrated with other options ({'; '.join(changed)}): "
            "resume with the checkpoint's calibration options, or train from the start"
        )
    recorder.policy.load_state_dict(state["policy"])
    recorder._announced, recorder.step = int(state["announced"]), step
    recorder.lengths = resumed_lengths(state.get("lengths"), step, recorder.policy.total_steps)
    if not main_process:
        return
    tracker, lost, note = None, None, None
    if recorder.tracking is None:
        if state["run_id"] is not None:
            lost = f"its records are in MLflow run {state['run_id']} and this run has tracking=None"
        elif state["csv"] is not None:
            path, lost = _csv_to_continue(recorder.csv_path, Path(state["csv"]), path)
    else:
        store, parent, recorder.store_label = open_store(recorder.tracking, recorder.experiment)
        run, lost = _find_run(store, recorder.store_label, state)
        if run is not None:  # reopened, or a new run branching from it (``sweep.integrations.branch``)
            tracker, note, lost = continue_run(
                store, run, step, state["csv"], parent=parent, name=run_name, tags=tags, params=params
            )
        else:
            tracker = new_run(store, parent, run_name, tags, params)
        path = tracker.artifact_path("steps.csv")
    recorder.tracker = tracker
    if lost is None and not path.exists():
        lost = f"{path} is missing"
    try:
        recorder.writer, recorder.records.rows = _continue_csv(path, recorder.columns, step, lost)
    except BaseException:
        if tracker is not None:
            tracker.end("FAILED")
        raise
    if tracker is not None:  # the steps' metrics the store lacks (a kill cuts its sends short)
        for i, row in enumerate(recorder.records.rows):
            tracker.add_step(row["step"], recorder.records.step_metrics(i))
        tracker.hold_after(step)  # the checkpoint's: the steps after it wait for the next one (or the end)
    if note is not None:
        recorder.say(note)
    recorder.say(f"steps.csv: {path} (resumed at step {step})")


def _find_run(store, label: str, state: dict[str, Any]):
    """The checkpoint's MLflow run (an MLflow ``Run``), or ``None`` and why it cannot be continued."""
    run_id = state["run_id"]
    if run_id is None:
        return None, f"its records are in {state['csv']}, not in an MLflow run"
    if state["tracking_uri"] != label:
        return None, f"its MLflow run {run_id} is in {state['tracking_uri']} and this run tracks to {label}"
    try:
        run = store.client.get_run(run_id)
    except Exception as e:  # MLflow's own error for a run it does not hold
        return None, f"its MLflow run {run_id} is not in {label} ({one_line(e, 120)})"
    if run.info.lifecycle_stage == "deleted":
        return None, f"its MLflow run {run_id} was deleted from {label}"
    return run, None


def _csv_to_continue(named: str | Path | None, saved: Path, own: Path) -> tuple[Path, str | None]:
    """The ``steps.csv`` a CSV-only resume writes, and why it cannot continue the checkpoint's (``None``: it can).
    The checkpoint's own where this run names none (``csv_path``) and it is still there; else this run's
    (``own``: ``csv_path``, or the default under this run's output folder), continued where it exists (the
    checkpoint's CSV copied or moved with the folder), never a CSV recreated where the checkpoint left one."""
    if named is None and saved.exists():
        return saved, None
    if own.exists():
        return own, None
    if named is None or own.absolute() == saved:
        return own, f"{saved} is missing"
    return own, f"its records are in {saved} and this run writes {own} (csv_path), which does not exist"


def _continue_csv(path: Path, columns, step: int, lost: str | None):
    """The writer continuing ``path`` after ``step`` and rows 1..step read back from it; a new CSV if ``lost``."""
    if lost is not None:
        warnings.warn(
            f"clipamp: resuming at step {step}: {lost}, so steps 1–{step} are not in this run's records: "
            f"a new steps.csv ({path}) starts at step {step + 1} and the summary covers those steps; "
            "the calibration continues from the checkpoint",
            ResumeWarning,
            stacklevel=2,
        )
        return StepCSVWriter(path, columns), []
    writer = StepCSVWriter(path, columns, truncate_after=step)
    rows = read_rows(path)
    if [r["step"] for r in rows] != list(range(1, step + 1)):
        warnings.warn(
            f"clipamp: resuming at step {step}: {path} holds {len(rows)} rows, not steps 1–{step}: the summary "
            "covers the steps it holds",
            ResumeWarning,
            stacklevel=2,
        )
    return writer, rows
