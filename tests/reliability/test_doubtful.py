"""Decided doubtful cases: a run whose every step was skipped ends FAILED with exit status 3 and one
line naming the skip reasons; a store created beside checkpoints it cannot know says so."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from tests.app.helpers import TINY, run_cli
from tests.reliability.helpers import assert_one_line_error, csv_steps, kill_between_checkpoints, start_run

pytestmark = pytest.mark.slow


def test_a_run_that_skipped_every_step_fails_with_status_3(tmp_path, store):
    res = run_cli("+experiment=train", *TINY, "steps=3", "faults.nan_loss=[1,2,3]", cwd=tmp_path)
    assert_one_line_error(res, "all 3 steps were skipped (nonfinite_loss ×3): nothing was trained", status=3)
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["failure_reason"].startswith("all 3 steps were skipped")
    assert run.data.metrics["skip_ratio"] == 1.0  # the summary is kept


def test_skipped_steps_are_a_normal_run_and_the_alarm_is_one_line(tmp_path, store):
    """Six NaN losses in 100 steps: exit 0, and the engine's skip-rate alarm is one ``warning:`` line, not
    Python's ``…/sweep/run/loop.py:247: SkipRateWarning: …`` with the loop's source line under it."""
    nan_at = "faults.nan_loss=[1,2,3,4,5,6]"
    res = run_cli(
        "+experiment=train", *TINY, "steps=100", "optim.warmup_steps=1", nan_at, "progress=false", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.splitlines() == [
        "warning: skip rate 6.0% over the last 100 steps exceeds 5.0% (step 100): the loop is skipping too many updates"
    ]


def test_a_new_store_beside_orphaned_checkpoints_says_so(tmp_path, store):
    proc, csv = start_run("+experiment=train", *TINY, "steps=100000", "checkpoint_every=5", cwd=tmp_path)
    kill_between_checkpoints(proc, csv, 5, 6)
    assert csv_steps(csv)
    db = tmp_path / "mlruns" / "mlflow.db"
    db.unlink()
    res = run_cli("+experiment=train", *TINY, "steps=2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    warnings = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "holds 1 checkpoint(s) of runs it does not know" in warnings[0], res.stderr
    assert "resume=true cannot continue them" in warnings[0]
