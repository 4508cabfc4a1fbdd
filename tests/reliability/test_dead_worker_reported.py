"""A trial whose sweep worker of this host died (its lock free: the OS released it, SIGKILL included) is
reported as such, not as running: by a surviving worker's last line and by ``python -m sweep.report``,
which ask the lock as the recovery does (``sweep.run.liveness``). A worker that holds its lock, or one on
another host (which this host cannot probe), is still running."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from sweep.commands import python_command
from sweep.experiments.study.sweep import mark_died, unfinished_line
from sweep.report import cli
from sweep.results.study import trials_table
from sweep.tracking.tracker import Store

STUDY = "dead-worker"

REPORT = python_command("sweep.report")  # the command the messages name


@pytest.fixture
def held(tmp_path):
    """A lock file held by a live process, as a live worker holds its ``run.lock``."""
    path = tmp_path / "alive.lock"
    code = (
        "import filelock, sys, time\n"
        "lock = filelock.FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield path
    proc.kill()
    proc.wait()


def _worker(store: Store, study, name: str, host: str, lock: Path) -> int:
    """A worker's RUNNING parent run (tags as ``hold_worker`` writes them), its RUNNING trial run (tags as
    ``run_trial`` writes them) and its RUNNING trial; the trial's number."""
    lock.touch()
    parent = store.client.create_run(
        store.experiment_id,
        run_name=name,
        tags={"study": STUDY, "sweep_role": "parent", "worker_host": host, "worker_lock": str(lock)},
    ).info.run_id
    trial = study.ask()
    trial.set_user_attr("parent_run_id", parent)
    store.client.create_run(
        store.experiment_id,
        run_name=f"trial-{trial.number}",
        tags={
            "mlflow.parentRunId": parent,
            "sweep_parent": parent,
            "sweep_role": "trial",
            "study": STUDY,
            "trial": str(trial.number),
        },
    )
    return trial.number


@pytest.fixture
def workers(tmp_path, store, held):
    """Three workers of one study: one dead on this host, one alive on this host, one on another host."""
    opened = Store.open(store, "clipamp")
    study = optuna.create_study(storage=f"sqlite:///{tmp_path}/optuna.db", study_name=STUDY)
    here = socket.gethostname()
    dead = _worker(opened, study, "dead", here, tmp_path / "dead.lock")  # nobody holds it: the process is gone
    alive = _worker(opened, study, "alive", here, held)
    away = _worker(opened, study, "away", "another-host", tmp_path / "away.lock")
    return opened, study, dead, alive, away


def test_the_surviving_workers_last_line_names_the_dead_workers_trial(workers):
    store, study, dead, alive, away = workers
    table = mark_died(trials_table(study, (0.01, 0.2)), store.client, own_parent="this-worker")
    states = dict(zip(table["trial"], table["state"]))
    assert states == {dead: "DIED", alive: "RUNNING", away: "RUNNING"}
    assert unfinished_line(table["state"]) == (
        "the pick covers the trials finished so far: 2 running in other workers and 1 whose worker died, which "
        "the next run of this command recovers (marked FAIL, its parameters run again); once they end, "
        f"`{REPORT}` gives the study's pick"
    )


def test_the_report_calls_the_dead_workers_trial_died_not_running(workers, store, capsys):
    _, _, dead, alive, away = workers
    ((name, df, *_),) = cli.sweeps_tables(Store.open(store, "clipamp").client, "clipamp")
    assert name == STUDY and dict(zip(df["trial"], df["state"])) == {dead: "DIED", alive: "RUNNING", away: "RUNNING"}
    assert cli.main(["--tracking-uri", store]) == 0
    out = capsys.readouterr().out
    assert (
        f"1 trial whose worker died (trial {dead}): re-run the sweep command to recover it (marked FAIL, its "
        "parameters run again)"
    ) in out
    table = out[out.index(f"Study {STUDY}") :]
    assert table.count("│ running") == 2 and table.count("│ died") == 1, table


def test_a_recovered_trial_is_killed_with_its_steps_and_run_in_both_tables(workers):
    """After the recovery, the sweep's own table (Optuna) says what ``sweep.report`` (MLflow) says of the dead
    worker's trial: KILLED, the steps its run logged, its run id. Before, it said 'failed, 0 steps, no run'."""
    from sweep.experiments.study.storage import open_storage
    from sweep.experiments.study.workers import recover_dead_workers

    store, study, dead, *_ = workers
    study = optuna.load_study(study_name=STUDY, storage=open_storage(study._storage._backend.url))  # as a sweep does
    [run] = store.client.search_runs([store.experiment_id], filter_string=f"tags.trial = '{dead}'")
    for step in range(1, 8):  # the steps it ran before its worker died
        store.client.log_metric(run.info.run_id, "loss", 3.0, step=step)
    lines: list[str] = []
    assert recover_dead_workers(study, store, lines.append) == [dead]
    own = trials_table(study, (0.01, 0.2))
    ((_, report, *_),) = cli.sweeps_tables(store.client, "clipamp")
    cols = ["trial", "state", "steps_run", "run_id"]
    mine = own[own["trial"] == dead][cols].values.tolist()
    assert mine == report[report["trial"] == dead][cols].values.tolist() == [[dead, "KILLED", 7, run.info.run_id]]
    retry = [t for t in study.get_trials() if t.state.name == "WAITING"]  # its parameters, none of its figures
    assert len(retry) == 1 and not {"outcome", "run_id", "steps_run"} & set(retry[0].user_attrs)
