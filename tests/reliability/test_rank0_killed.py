"""Under torchrun, rank 0 killed without a word (SIGKILL): its peer prints the one line (rank 0 cannot),
and only one peer does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from sweep.distributed.rank_failure import diagnose


def test_rank_1_reports_a_silently_dead_rank_0(sigterm_restored, dead_pid):
    store = dist.HashStore()
    pids = {0: dead_pid, 1: os.getpid(), 2: os.getpid()}
    for rank, pid in pids.items():
        store.set(f"pid/{rank}", f"{os.uname().nodename}:{pid}")
    broken = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    seen = diagnose(broken, store, rank=1, world=3)
    assert (seen.rank, seen.cause, seen.status) == (0, None, "KILLED")
    assert seen.report(1).startswith("rank 0 of 3 died without an error (killed by a signal")
    assert "resume=true continues from the last checkpoint" in seen.report(1)
    assert diagnose(broken, store, rank=2, world=3).report(2) is None  # one line, not one per rank


@pytest.mark.slow
def test_rank_0_sigkilled_under_torchrun_one_line_then_resume_keeps_every_step(tmp_path):
    """End to end (2 gloo ranks): rank 0 SIGKILLs itself at step 7 (checkpoint at 4); rank 1 prints the
    line; a one-process resume finishes the run with MLflow's history equal to steps.csv row by row."""
    import csv as csvlib

    from mlflow import MlflowClient

    from tests.app.run.test_rank_failure import ENV, RUN, STEPS, TORCHRUN

    res = subprocess.run(
        [*TORCHRUN, *RUN],
        cwd=tmp_path,
        env={**ENV, "CLIPAMP_TEST_RANK_FAULT": "kill:0:7"},
        capture_output=True,
        text=True,
        timeout=400,
    )
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode != 0 and len(errors) == 1, res.stderr[-3000:]
    assert errors[0].startswith("error: rank 0 of 2 died without an error (killed by a signal"), errors
    resumed = subprocess.run(
        [sys.executable, "-m", "sweep", *RUN, "resume=true"], cwd=tmp_path, env=ENV, capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    csv = next(tmp_path.glob("mlruns/artifacts/clipamp/*/artifacts/steps.csv"))
    with open(csv, newline="") as f:
        rows = list(csvlib.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    run_id = csv.parts[-3]
    for key in ("loss", "lr", "grad_l2_pre_clip"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(int(r["step"]), float(r[key])) for r in rows], key
