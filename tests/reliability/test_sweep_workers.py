"""Issue 12 items 9 and 10: sweep workers that die or start together.

9: a worker killed by SIGKILL (mid-trial or in the anchor window) is recovered by the next invocation
at once, long before ``study.grace_period``: its trial FAIL and re-run, its trial/anchor and parent
runs KILLED, one line saying so. 10: three workers started together on one sqlite study run one
anchor window, enqueue each dtype once, try distinct points, and the last to end picks what
``sweep.report`` picks."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from sweep.report.cli import sweeps_tables
from tests.app.helpers import TINY, store_in
from tests.reliability.helpers import finish, start_cli

pytestmark = pytest.mark.slow  # real sweep processes

ARGS = [
    "+experiment=sweep",
    *TINY,
    "study=pareto",
    "study.dtypes=[bf16,fp32]",
    "calibrate.window=8",
    "optim.warmup_steps=2",
    "study.heartbeat_interval=1",
    "study.grace_period=600",
]


def _folder(tmp_path: Path, store_template: Path) -> Path:
    store_in(tmp_path, store_template)
    return tmp_path


def _runs(client: MlflowClient) -> list:
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps, max_results=1000)


def _study(tmp: Path) -> optuna.Study:
    storage = f"sqlite:///{tmp}/mlruns/optuna.db"
    (name,) = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name, storage=storage)


def _kill_when(proc, client: MlflowClient, role: str, rows: int) -> None:
    """SIGKILL ``proc`` once a RUNNING run with ``sweep_role=role`` has written ``rows`` CSV rows, checked
    again with the process frozen (a short run can end between the search and the kill)."""
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        for run in _runs(client):
            if run.data.tags.get("sweep_role") == role and run.info.status == "RUNNING":
                csv = Path(run.info.artifact_uri.removeprefix("file://")) / "steps.csv"
                if csv.exists() and csv.read_text().count("\n") > rows:
                    proc.send_signal(signal.SIGSTOP)  # frozen: is that run still the one in progress?
                    try:
                        still = client.get_run(run.info.run_id).info.status == "RUNNING"
                    except Exception:  # e.g. the store locked by a write the stop froze: look again
                        still = False
                    if still:
                        proc.send_signal(signal.SIGKILL)
                        proc.wait()
                        return
                    proc.send_signal(signal.SIGCONT)  # it ended meanwhile: wait for the next one
        time.sleep(0.2)
    raise AssertionError(f"no {role} run reached {rows} rows; {proc.poll()=}")


@pytest.mark.parametrize("role", ["trial", "anchor"])
def test_a_killed_worker_is_recovered_at_once(tmp_path, store_template, role):
    tmp = _folder(tmp_path, store_template)
    client = MlflowClient(f"sqlite:///{tmp}/mlruns/mlflow.db")
    args = [*ARGS, "steps=150", "study.n_trials=2", f"calibrate.window={8 if role == 'trial' else 120}"]
    _kill_when(start_cli(*args, cwd=tmp), client, role, 20 if role == "trial" else 2)  # the window is short
    before = {r.info.run_id: r for r in _runs(client) if r.info.status == "RUNNING"}
    dead_parent = next(r for r in before.values() if r.data.tags.get("sweep_role") == "parent")
    assert sorted(r.data.tags["sweep_role"] for r in before.values()) == sorted(["parent", role])
    killed = _study(tmp).trials if role == "trial" else []

    t0 = time.monotonic()
    res = finish(start_cli(*args, cwd=tmp))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert time.monotonic() - t0 < 600  # no grace period waited for
    lines = [line for line in res.stdout.splitlines() if line.startswith("recovered")]
    assert len(lines) == 1, res.stdout
    assert ("trials [0] marked FAIL" if role == "trial" else "no trial of theirs was running") in lines[0]
    assert f"sweep-{dead_parent.data.tags['study']} (parent)" in lines[0]

    runs = _runs(client)
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []
    for run_id in before:  # every run of the dead worker: KILLED, marked
        now = client.get_run(run_id)
        assert now.info.status == "KILLED" and now.data.tags["outcome"] == "worker died", now.info.run_name
    trials = _study(tmp).trials
    assert not [t.number for t in trials if t.state.name in ("RUNNING", "WAITING")]
    if role == "trial":
        assert trials[0].state.name == "FAIL"
        retried = [t for t in trials[1:] if t.params == killed[0].params]
        assert len(retried) == 1 and retried[0].state.name == "COMPLETE"  # its parameters ran again, once
    else:  # the dead window is not the study's anchor: a new one ran, to its end
        anchors = [r for r in runs if r.data.tags.get("sweep_role") == "anchor"]
        assert sorted(r.info.status for r in anchors) == ["FINISHED", "KILLED"]
        assert _study(tmp).user_attrs["anchor"]["source_run_id"] not in before
    trial_runs = [r for r in runs if r.data.tags.get("sweep_role") == "trial"]
    assert len(trial_runs) == len(trials)  # one run per trial, none lost or doubled


def test_workers_started_together_share_one_set_up(tmp_path, store_template):
    tmp = _folder(tmp_path, store_template)
    args = [*ARGS, "steps=30", "study.n_trials=2", "study.heartbeat_interval=2", "study.grace_period=60"]
    procs = [start_cli(*args, cwd=tmp) for _ in range(3)]
    results = [finish(p) for p in procs]
    for res in results:
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    client = MlflowClient(f"sqlite:///{tmp}/mlruns/mlflow.db")
    runs = _runs(client)
    roles = [r.data.tags.get("sweep_role") for r in runs]
    assert roles.count("anchor") == 1 and roles.count("parent") == 3 and roles.count("trial") == 6
    assert {r.info.status for r in runs} == {"FINISHED"}
    study = _study(tmp)
    trials = study.trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 6
    points = {(t.params["dtype"], t.params["max_norm"]) for t in trials}
    assert len(points) == 6  # no duplicate enqueue, no two samplers drawing the same τ
    p95 = study.user_attrs["anchor"]["p95"]
    at_p95 = sorted(t.params["dtype"] for t in trials if t.params["max_norm"] == p95)
    assert at_p95 == ["bf16", "fp32"], at_p95  # each dtype enqueued at the anchor once
    parents = {r.info.run_id: r for r in runs if r.data.tags.get("sweep_role") == "parent"}
    assert {r.data.tags["study"] for r in parents.values()} == {study.study_name}  # linked by the study
    assert {t.user_attrs["parent_run_id"] for t in trials} <= set(parents)
    last = max(parents.values(), key=lambda r: r.info.end_time)
    ((name, _, pick, _, _),) = sweeps_tables(client, "clipamp")
    assert name == study.study_name and pick is not None
    assert last.data.tags["pick_trial"] == str(pick.trial)
    printed = {int(m) for res in results for m in re.findall(r"Pick: trial (\d+)", res.stdout)}
    assert pick.trial in printed
