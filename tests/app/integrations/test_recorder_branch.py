"""A host's run resumed from a checkpoint older than the steps its MLflow run holds (a finished run resumed from
an earlier checkpoint to try another setting; a run killed after a later checkpoint resumed from an earlier one):
MLflow cannot drop the run's later points, so the resume records in a new run that holds the first run's steps
up to the checkpoint, then its own: its history is its ``steps.csv``, and the first run is left as it was."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from sweep.integrations.recorder import StepRecorder
from sweep.integrations.resume import ResumeWarning
from sweep.run.loop import STEP_METRICS
from sweep.run.summary import read_rows

STEPS, EARLY, LATE, KILL = 12, 3, 6, 8  # checkpoints at steps 3 and 6; a killed run stops after step 8


def _steps(rec: StepRecorder, steps: range, scale: float) -> dict[int, dict]:
    """Record ``steps`` (gradient ``scale`` × step, every send made at once); the states saved at EARLY and LATE."""
    p, saved = torch.nn.Parameter(torch.zeros(3)), {}
    for step in steps:
        p.grad = torch.full((3,), scale * step)
        rec.record(step, 1e-3 * step, rec.measure([p], step, host_clips=False, loss=torch.tensor(scale / step)))
        if step in (EARLY, LATE):
            saved[step] = json.loads(json.dumps(rec.checkpoint_state()))
        rec.tracker.flush()  # what flush_every does in a longer run: nothing unsent when it stops
    return saved


def _history(client, run_id: str) -> dict[str, list[tuple[int, float]]]:
    run = client.get_run(run_id)
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in run.data.metrics}


@pytest.mark.parametrize("first_end,resume_from", [("FINISHED", LATE), ("KILLED", EARLY)])
def test_a_resume_from_an_older_checkpoint_records_in_a_new_run_equal_to_its_csv(
    tmp_path, store, capsys, first_end, resume_from
):
    make = lambda: StepRecorder(calibrate={"window": 4, "start": 2}, tracking=store)  # noqa: E731
    first = make()
    first.begin(total_steps=STEPS, user_tau=0.5, default_csv=tmp_path / "unused.csv")
    saved = _steps(first, range(1, (STEPS if first_end == "FINISHED" else KILL) + 1), 0.1)
    first.end(STEPS) if first_end == "FINISHED" else first.abort("KILLED")
    client, parent = MlflowClient(store), saved[resume_from]["run_id"]
    before, parent_csv = _history(client, parent), saved[resume_from]["csv"]
    parent_rows = open(parent_csv).read()
    assert max(s for h in before.values() for s, _ in h) > resume_from  # the run holds steps past the checkpoint
    capsys.readouterr()
    again = make()  # resumed with other gradients: steps after the checkpoint get other values
    again.begin(total_steps=STEPS, user_tau=0.5, default_csv=tmp_path / "unused.csv", resume=saved[resume_from])
    _steps(again, range(resume_from + 1, STEPS + 1), 0.3)
    again.end(STEPS)
    [new] = [r for r in client.search_runs([client.get_run(parent).info.experiment_id]) if r.info.run_id != parent]
    assert new.info.status == "FINISHED"
    assert {k: new.data.tags[k] for k in ("resumed.from_run", "resumed.from_step")} == {
        "resumed.from_run": parent,
        "resumed.from_step": str(resume_from),
    }
    csv = client.download_artifacts(new.info.run_id, "steps.csv", str(tmp_path / "new"))
    rows = read_rows(csv)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert open(csv).read().splitlines()[: resume_from + 1] == parent_rows.splitlines()[: resume_from + 1]
    for key in STEP_METRICS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(new.info.run_id, key))
        assert history == [(r["step"], float(r[key])) for r in rows if math.isfinite(r[key])], key
    assert _history(client, parent) == before and open(parent_csv).read() == parent_rows  # left as it was
    assert (
        f"clipamp: MLflow run {parent} holds steps up to {max(s for h in before.values() for s, _ in h)}, past the "
        f"checkpoint's step {resume_from}, and MLflow cannot remove them: the resume records in a new run "
        f"{new.info.run_id} (tags resumed.from_run, resumed.from_step) that begins with that run's steps "
        f"1–{resume_from}\n"
    ) in capsys.readouterr().out


def test_a_new_run_without_the_first_runs_csv_is_said_and_holds_the_resumes_steps(tmp_path, store):
    """The finished run's steps.csv gone: the new run cannot hold its steps 1–6 (one warning line says so), and
    holds the resume's steps only, as its steps.csv does."""
    make = lambda: StepRecorder(calibrate={"window": 4, "start": 2}, verbose=False, tracking=store)  # noqa: E731
    first = make()
    first.begin(total_steps=STEPS, user_tau=0.5, default_csv=tmp_path / "unused.csv")
    saved = _steps(first, range(1, STEPS + 1), 0.1)[LATE]
    first.end(STEPS)
    Path(saved["csv"]).unlink()
    again = make()
    with pytest.warns(ResumeWarning) as caught:
        again.begin(total_steps=STEPS, user_tau=0.5, default_csv=tmp_path / "unused.csv", resume=saved)
    new = again.tracker.artifact_path("steps.csv")
    assert [str(w.message) for w in caught if w.category is ResumeWarning] == [
        f"clipamp: resuming at step 6: {saved['csv']} is missing, so steps 1–6 are not in this run's records: a new "
        f"steps.csv ({new}) starts at step 7 and the summary covers those steps; the calibration continues from the "
        "checkpoint"
    ]
    _steps(again, range(LATE + 1, STEPS + 1), 0.3)
    again.end(STEPS)
    client = MlflowClient(store)
    assert client.get_run(again.tracker.run_id).data.tags["resumed.from_run"] == saved["run_id"]
    history = sorted(m.step for m in client.get_metric_history(again.tracker.run_id, "grad_l2_pre_clip"))
    assert history == [r["step"] for r in read_rows(new)] == list(range(LATE + 1, STEPS + 1))
