"""A rank that fails under torchrun (2 gloo ranks on CPU): one line from rank 0, nothing lost.

End to end, ``model=custom`` (``rank_faults.RankFault``) makes rank 1 raise in its 7th training
forward, or SIGKILL itself there as the OOM killer would; checkpoints every 4 steps. The run must end
with exactly one ``error:`` line naming the rank and the cause, the MLflow run FAILED (an error: a bug,
as in one process) or KILLED (a rank killed from outside), ``steps.csv`` holding steps 1–6 exactly as
an uninterrupted one-process run has them, and ``resume=true`` continuing the run to the end.
The fast tests drive the diagnosis on a real in-memory c10d store and real dead/live processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist
from mlflow import MlflowClient

from sweep.distributed.rank_failure import RankFailed, diagnose, register
from tests.app.helpers import csv_of, repo_pythonpath

ENV = {
    **{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
    "PYTHONUNBUFFERED": "1",
    "PYTHONPATH": repo_pythonpath(),
}
STEPS = 12
RUN = [
    "+experiment=train",
    "model=custom",
    "model._target_=tests.app.run.rank_faults.RankFault",
    "data.batch_size=4",
    "data.seq_len=32",
    "data.max_files=40",
    "data.eval_batches=1",
    "progress=false",
    "tracking.plots=false",
    f"steps={STEPS}",
    "checkpoint_every=4",
    "amp.dtype=fp32",
    "dist.timeout_s=120",
]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "sweep"]
KEPT = "the run ended {}, steps.csv keeps steps 1–6; resume=true continues from the checkpoint at step 4"


# -- the diagnosis (no process group) ------------------------------------------------------------


def _store(pids: dict[int, int]) -> dist.Store:
    store = dist.HashStore()
    for rank, pid in pids.items():
        store.set(f"pid/{rank}", f"{os.uname().nodename}:{pid}")
    return store


@pytest.mark.slow  # waits out a 3 s liveness poll
def test_own_failure_is_recorded_and_reported_by_rank_0(sigterm_restored):
    store = _store({0: os.getpid(), 1: os.getpid()})
    failure = diagnose(RuntimeError("bad\nvalue"), store, rank=1, world=2)
    assert failure.own and failure.status == "FAILED"
    assert store.get("failed/1") == b"RuntimeError: bad value"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # torchrun's SIGTERM cannot cut the report short
    assert failure.report(1) is None  # rank 0 is alive: it reports
    peer = diagnose(dist.DistError("Connection closed by peer"), store, rank=0, world=2)
    assert (peer.rank, peer.cause, peer.own) == (1, "RuntimeError: bad value", False)
    peer.kept(6, 4)
    assert peer.report(0) == f"rank 1 of 2 failed: RuntimeError: bad value; {KEPT.format('FAILED')}"


def test_a_failing_rank_reports_itself_when_rank_0_is_gone(sigterm_restored, dead_pid):
    store = _store({0: dead_pid, 1: os.getpid()})
    assert diagnose(ValueError("x"), store, rank=1, world=2).report(1) == "rank 1 of 2 failed: ValueError: x"


def test_a_failing_rank_stays_quiet_when_rank_0_reported_before_it_left(sigterm_restored, dead_pid):
    """Every rank raising the same error (clip=agc under FSDP2 did): rank 0 prints and exits, and rank 1 found
    it gone and printed the line again; now rank 0's report is recorded and rank 1 says nothing."""
    store = _store({0: dead_pid, 1: os.getpid()})
    zero = RankFailed(0, 2, "RuntimeError: x", own=True, store=store)
    assert zero.report(0) == "rank 0 of 2 failed: RuntimeError: x" and store.check(["reported"])
    assert diagnose(RuntimeError("x"), store, rank=1, world=2).report(1) is None


def test_a_silently_dead_rank_is_named_and_the_run_ends_killed(sigterm_restored, dead_pid):
    store = _store({0: os.getpid(), 1: os.getpid(), 2: dead_pid})
    failure = diagnose(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"), store, 0, 3)
    assert (failure.rank, failure.cause, failure.status) == (2, None, "KILLED")
    failure.kept(None, None)
    assert failure.report(0) == (
        "rank 2 of 3 died without an error (killed by a signal, e.g. the OOM killer; "
        "torchrun's summary gives its exit code); the run ended KILLED, steps.csv keeps "
        "no step; no checkpoint was written yet (checkpoint_every=): start a new run"
    )


@pytest.mark.slow  # waits out a 3 s liveness poll
def test_an_unknown_dead_rank_stays_unnamed(sigterm_restored):
    store = _store({0: os.getpid(), 1: os.getpid()})  # every process alive: nothing to name
    failure = diagnose(dist.DistError("timeout"), store, 0, 2)
    assert failure.rank is None and failure.line().startswith("another rank of 2 died without an error")
    assert isinstance(failure, RankFailed)


def test_register_records_host_and_pid():
    store = dist.HashStore()
    register(store, 3)
    assert store.get("pid/3").decode() == f"{os.uname().nodename}:{os.getpid()}"


# -- end to end ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> pd.DataFrame:
    tmp = tmp_path_factory.mktemp("one")
    res = subprocess.run(
        [sys.executable, "-m", "sweep", *RUN], cwd=tmp, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return pd.read_csv(csv_of(res.stdout))


def _fail_rank_1(tmp: Path, how: str) -> tuple[subprocess.CompletedProcess, Path, str]:
    res = subprocess.run(
        [*TORCHRUN, *RUN],
        cwd=tmp,
        env={**ENV, "CLIPAMP_TEST_RANK_FAULT": f"{how}:1:7"},
        capture_output=True,
        text=True,
        timeout=400,
    )  # rank 0 must not hang
    assert res.returncode != 0 and res.stdout.count("steps.csv: ") == 1, res.stderr[-3000:]
    ours = [
        l
        for l in res.stderr.splitlines()
        if l.strip().startswith('File "') and "site-packages" not in l and "<frozen" not in l
    ]
    assert ours == [], "a traceback from our code"
    csv = csv_of(res.stdout)
    return res, csv, csv.parts[-3]


def _same_rows(rows: pd.DataFrame, ref: pd.DataFrame) -> None:
    assert rows["step"].tolist() == ref["step"].tolist()
    for col in ("grad_l2_pre_clip", "grad_l2_post_clip", "loss", "lr"):
        torch.testing.assert_close(
            torch.tensor(rows[col].to_numpy()), torch.tensor(ref[col].to_numpy()), rtol=1e-5, atol=1e-7, msg=col
        )


@pytest.mark.slow
def test_an_error_on_one_rank_is_one_line_and_the_run_ends_failed(tmp_path, one_process):
    res, csv, run_id = _fail_rank_1(tmp_path, "raise")
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert errors == [
        "error: rank 1 of 2 failed: RuntimeError: injected fault in forward at step 7; " + KEPT.format("FAILED")
    ]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    assert client.get_run(run_id).info.status == "FAILED"
    _same_rows(pd.read_csv(csv), one_process.iloc[:6])  # every completed step, as one process has it
    assert (tmp_path / "mlruns" / "checkpoints" / run_id / "checkpoint.pt").exists()


@pytest.mark.slow
def test_a_killed_rank_ends_the_run_killed_and_resume_finishes_it(tmp_path, one_process):
    res, csv, run_id = _fail_rank_1(tmp_path, "kill")
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert errors == [
        "error: rank 1 of 2 died without an error (killed by a signal, e.g. the OOM killer; "
        "torchrun's summary gives its exit code); " + KEPT.format("KILLED")
    ]
    assert "exitcode  : -9" in res.stderr  # torchrun's summary: rank 1 got SIGKILL
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    assert client.get_run(run_id).info.status == "KILLED"
    assert pd.read_csv(csv)["step"].tolist() == list(range(1, 7))
    # the DDP checkpoint is a one-process checkpoint: resume in one process, to the end, every step once
    resumed = subprocess.run(
        [sys.executable, "-m", "sweep", *RUN, "resume=true"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0 and f"resumed run {run_id} at step 4" in resumed.stdout, resumed.stderr[-3000:]
    _same_rows(pd.read_csv(csv), one_process)
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_collective_timeout_names_the_silent_peer_not_this_rank(sigterm_restored):
    """A rank stopped (SIGSTOP) or hung: the others' collective times out after dist.timeout_s; the line says
    another rank stopped answering, not that rank 0 failed with its own error."""
    store = _store({0: os.getpid(), 1: os.getpid()})
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation"
    )
    failure = diagnose(gloo, store, rank=0, world=2)
    assert not failure.own and failure.rank is None and failure.status == "FAILED"
    assert store.check(["failed/0"]) is False  # not recorded as this rank's own failure
    failure.kept(6, 4)
    assert failure.report(0) == (
        "another rank of 2 stopped answering: a collective waited dist.timeout_s for it and timed out (RuntimeError: "
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation); "
        f"a hung or stopped process (a deadlock, SIGSTOP, a stuck filesystem); {KEPT.format('FAILED')}"
    )
