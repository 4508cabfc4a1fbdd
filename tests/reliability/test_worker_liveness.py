"""Which sweep workers are dead, as the next worker's recovery judges them (``workers.recover_dead_workers``).

Real stores (an MLflow sqlite store, an Optuna sqlite storage with heartbeats) and real worker locks, held
by a live process or by none. A worker of this host that holds its lock is alive whatever its heartbeat
says; a worker of another host is judged by the heartbeat; only the trials the recovery fails are blamed
(a live worker that fails its own trial meanwhile keeps its runs)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from sweep.experiments.study.storage import open_storage
from sweep.experiments.study.workers import recover_dead_workers
from sweep.tracking.tracker import Store

GRACE = 1  # seconds: Optuna's smallest grace period


@pytest.fixture
def lock_holder(tmp_path):
    """A live process holding the lock at the path it is given, as a worker holds ``run.lock``."""
    procs = []

    def hold(path: Path) -> None:
        code = (
            "import filelock, sys, time\n"
            "lock = filelock.FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True); time.sleep(600)"
        )
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def _worker(store: Store, study, tmp_path: Path, name: str, host: str) -> tuple[str, optuna.trial.Trial, str]:
    """A worker's RUNNING parent run (tags as ``hold_worker`` writes them), its RUNNING trial run and its
    RUNNING trial, heartbeat recorded once; the parent's id, the trial, the lock's path."""
    lock = tmp_path / f"{name}.lock"
    lock.touch()
    parent = store.client.create_run(
        store.experiment_id,
        run_name=name,
        tags={"study": study.study_name, "sweep_role": "parent", "worker_host": host, "worker_lock": str(lock)},
    ).info.run_id
    store.client.create_run(
        store.experiment_id, run_name=f"{name}-trial", tags={"mlflow.parentRunId": parent, "sweep_role": "trial"}
    )
    trial = study.ask()
    trial.set_user_attr("parent_run_id", parent)
    study._storage.record_heartbeat(trial._trial_id)
    return parent, trial, str(lock)


def _status(store: Store, run_id: str) -> str:
    return store.client.get_run(run_id).info.status


def _children(store: Store, parent: str) -> list[str]:
    runs = store.client.search_runs([store.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")
    return [r.info.status for r in runs]


@pytest.fixture
def sweep_stores(tmp_path, store):
    opened = Store.open(store, "liveness")
    storage = open_storage(f"sqlite:///{tmp_path}/optuna.db", heartbeat_interval=1, grace_period=GRACE)
    return opened, optuna.create_study(storage=storage, study_name="live")


@pytest.mark.slow  # waits out the liveness grace period
def test_a_silent_worker_that_holds_its_lock_on_this_host_is_alive(tmp_path, sweep_stores, lock_holder):
    store, study = sweep_stores
    here = socket.gethostname()
    alive, alive_trial, alive_lock = _worker(store, study, tmp_path, "alive", here)
    lock_holder(alive_lock)
    gone, gone_trial, _ = _worker(store, study, tmp_path, "gone", here)  # lock free: the process is dead
    away, away_trial, _ = _worker(store, study, tmp_path, "away", "another-host")
    time.sleep(GRACE + 1.5)  # every heartbeat is now stale
    said = []

    assert recover_dead_workers(study, store, said.append) == sorted([gone_trial.number, away_trial.number])

    states = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    assert states[alive_trial.number] == TrialState.RUNNING
    assert (_status(store, alive), _children(store, alive)) == ("RUNNING", ["RUNNING"])
    for parent, trial in ((gone, gone_trial), (away, away_trial)):
        assert states[trial.number] == TrialState.FAIL
        assert (_status(store, parent), _children(store, parent)) == ("KILLED", ["KILLED"])
    retried = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert sorted(t.system_attrs["failed_trial"] for t in retried) == sorted([gone_trial.number, away_trial.number])
    assert said[0].startswith(
        f"recovered 2 dead sweep worker(s): trials {sorted([gone_trial.number, away_trial.number])}"
    )
    assert said[1].startswith(f"trials [{alive_trial.number}] are running in other live workers")


def test_a_trial_its_own_worker_fails_during_recovery_leaves_that_worker_alone(tmp_path, sweep_stores):
    """The live worker (another host, heartbeat fresh) fails its trial between the recovery's reads."""
    store, study = sweep_stores
    live, trial, _ = _worker(store, study, tmp_path, "live", "another-host")
    reads = study.get_trials

    def get_trials(*args, **kwargs):
        trials = reads(*args, **kwargs)
        if kwargs.get("states") == (TrialState.RUNNING,):
            study.get_trials = reads  # once: the worker's own tell lands right after the first read
            study.tell(trial, state=TrialState.FAIL)
        return trials

    study.get_trials = get_trials
    said = []

    assert recover_dead_workers(study, store, said.append) == []

    assert (_status(store, live), _children(store, live)) == ("RUNNING", ["RUNNING"])
    assert not study.get_trials(deepcopy=False, states=(TrialState.WAITING,))  # nothing re-enqueued
    assert said == []
