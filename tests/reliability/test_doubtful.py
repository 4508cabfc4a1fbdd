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


def test_one_skipped_step_is_a_normal_run(tmp_path, store):
    res = run_cli("+experiment=train", *TINY, "steps=3", "faults.nan_loss=[2]", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]


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
