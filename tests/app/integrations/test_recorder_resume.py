"""``StepRecorder.begin(resume=…)`` where the records cannot continue as the checkpoint left them: one
``ResumeWarning`` line naming why, and the records going on from the checkpoint's step."""

from __future__ import annotations

import json

import pytest
import torch
from mlflow import MlflowClient

from sweep.integrations.recorder import StepRecorder
from sweep.integrations.resume import ResumeWarning
from tests.app.helpers import store_in

STEPS, SAVE, KILL = 12, 6, 8


def train(rec: StepRecorder, csv, *, resume=None) -> dict | None:
    """Record steps up to KILL (from the checkpoint's, with ``resume``; to STEPS then, and end); the
    recorder's state at step SAVE as a checkpoint keeps it (JSON)."""
    rec.begin(total_steps=STEPS, user_tau=0.5, default_csv=csv, resume=resume)
    p, saved = torch.nn.Parameter(torch.zeros(3)), None
    for step in range(rec.step + 1, (STEPS if resume else KILL) + 1):
        p.grad = torch.full((3,), 0.1 * step)
        rec.record(step, 1e-3, rec.measure([p], step, host_clips=False))
        if step == SAVE:
            saved = json.loads(json.dumps(rec.checkpoint_state()))
    if resume:
        rec.end(STEPS)
    return saved


def recorder(**kw) -> StepRecorder:
    return StepRecorder(calibrate={"window": 4}, verbose=False, **{"tracking": None, **kw})


def test_a_csv_that_lacks_steps_is_continued_and_said(tmp_path):
    csv = tmp_path / "steps.csv"
    saved = train(recorder(), csv)
    lines = csv.read_text().splitlines(keepends=True)
    csv.write_text("".join(lines[:2] + lines[3:]))  # step 2 lost
    rec = recorder()
    with pytest.warns(ResumeWarning) as caught:
        train(rec, csv, resume=saved)
    assert [str(w.message) for w in caught if w.category is ResumeWarning] == [
        f"clipamp: resuming at step 6: {csv} holds 5 rows, not steps 1–6: the summary covers the steps it holds"
    ]
    assert [r["step"] for r in rec.records.rows] == [1, *range(3, STEPS + 1)]
    assert [int(line.split(",")[0]) for line in csv.read_text().splitlines()[1:]] == [1, *range(3, STEPS + 1)]


def test_a_run_in_another_store_is_said_and_a_new_run_starts(tmp_path, store, store_template):
    saved = train(recorder(tracking=store), tmp_path / "unused.csv")
    run_id = saved["run_id"]
    other = store_in(tmp_path / "other", store_template)
    rec = recorder(tracking=other)
    with pytest.warns(ResumeWarning) as caught:
        train(rec, tmp_path / "unused.csv", resume=saved)
    new = rec.tracker.artifact_path("steps.csv")
    assert [str(w.message) for w in caught if w.category is ResumeWarning] == [
        f"clipamp: resuming at step 6: its MLflow run {run_id} is in {store} and this run tracks to {other}, so "
        f"steps 1–6 are not in this run's records: a new steps.csv ({new}) starts at step 7 and the summary "
        "covers those steps; the calibration continues from the checkpoint"
    ]
    history = MlflowClient(other).get_metric_history(rec.tracker.run_id, "grad_l2_pre_clip")
    assert sorted(m.step for m in history) == list(range(SAVE + 1, STEPS + 1))
    assert len(MlflowClient(store).get_metric_history(run_id, "grad_l2_pre_clip")) < STEPS  # left as it was


@pytest.mark.parametrize("first,then", [("mlflow", None), (None, "mlflow")])
def test_records_kept_elsewhere_than_this_run_keeps_them_are_said(tmp_path, store, first, then):
    csv = tmp_path / "steps.csv"
    saved = train(recorder(tracking=store if first else None, csv_path=csv), csv)
    rec = recorder(tracking=store if then else None, csv_path=csv)
    with pytest.warns(ResumeWarning) as caught:
        train(rec, csv, resume=saved)
    [message] = [str(w.message) for w in caught if w.category is ResumeWarning]
    why = (
        f"its records are in MLflow run {saved['run_id']} and this run has tracking=None"
        if first
        else f"its records are in {csv}, not in an MLflow run"
    )
    assert message.startswith(f"clipamp: resuming at step 6: {why}, so steps 1–6 are not in this run's records")
    assert [r["step"] for r in rec.records.rows] == list(range(SAVE + 1, STEPS + 1))


def test_a_moved_output_folder_never_recreates_the_checkpoints_csv(tmp_path):
    """The checkpoint's CSV gone with its folder (the run resumed elsewhere): the new CSV is this run's own,
    under its output folder, and the old folder is not made again."""
    old, new = tmp_path / "old" / "clipamp" / "steps.csv", tmp_path / "new" / "clipamp" / "steps.csv"
    saved = train(recorder(), old)
    (tmp_path / "old").rename(tmp_path / "gone")
    rec = recorder()
    with pytest.warns(ResumeWarning, match=f"resuming at step 6: {old} is missing, .* a new steps.csv \\({new}\\)"):
        train(rec, new, resume=saved)
    assert not (tmp_path / "old").exists()
    assert [int(line.split(",")[0]) for line in new.read_text().splitlines()[1:]] == list(range(SAVE + 1, STEPS + 1))


@pytest.mark.parametrize("named", [False, True])
def test_a_copy_of_the_checkpoints_csv_where_this_run_writes_is_continued(tmp_path, named):
    """The output folder copied (``csv_path`` naming the copy, or the default under the copy): the copy goes on,
    steps 1–6 kept, and the checkpoint's CSV is left as it was."""
    old, new = tmp_path / "old" / "steps.csv", tmp_path / "new" / "steps.csv"
    saved = train(recorder(csv_path=old), old)
    before = old.read_text()
    new.parent.mkdir()
    new.write_text(before)
    rec = recorder(csv_path=new if named else None)
    if not named:
        old.unlink()
    train(rec, new, resume=saved)
    if named:
        assert old.read_text() == before
    assert [int(line.split(",")[0]) for line in new.read_text().splitlines()[1:]] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rec.records.rows] == list(range(1, STEPS + 1))


def test_a_csv_path_elsewhere_is_said_and_written_there(tmp_path):
    old, new = tmp_path / "old.csv", tmp_path / "new.csv"
    saved = train(recorder(csv_path=old), old)
    before = old.read_text()
    rec = recorder(csv_path=new)
    with pytest.warns(ResumeWarning) as caught:
        train(rec, new, resume=saved)
    [message] = [str(w.message) for w in caught if w.category is ResumeWarning]
    assert message.startswith(
        f"clipamp: resuming at step 6: its records are in {old} and this run writes {new} (csv_path), which does "
        f"not exist, so steps 1–6 are not in this run's records: a new steps.csv ({new}) starts at step 7"
    )
    assert old.read_text() == before
    assert [int(line.split(",")[0]) for line in new.read_text().splitlines()[1:]] == list(range(SAVE + 1, STEPS + 1))
