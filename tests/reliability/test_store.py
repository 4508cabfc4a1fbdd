"""Items 2 and 11: one store-opening path. A fresh store survives N processes racing to create it and
a kill during its creation; a store MLflow cannot use is refused with one line naming the repair."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from sweep.commands import mlflow_command
from sweep.errors import UserError
from sweep.tracking.tracker import Store
from tests.app.helpers import REPO, TINY, run_cli_here
from tests.reliability.helpers import assert_one_line_error, finish, open_and_log, start_cli

# Without the lock every repetition fails (the control below: MLflow's migrations collide, e.g.
# "duplicate column name: step"), so 5 repetitions tell the two apart; CLIPAMP_RACE_REPS=20 for the
# acceptance figure (measured: 60/60 for 3 processes, 40/40 under torchrun; each repetition costs a
# 5-10 s migration on 2 cores).
N_PROCESSES, REPETITIONS = 3, int(os.environ.get("CLIPAMP_RACE_REPS", "5"))
TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node=2",
    str(Path(__file__).with_name("store_race_ranks.py")),
]


def _open_and_log(barrier, jobs, results) -> None:
    """Worker: for each fresh folder, wait for the others, then open the store there and log one run."""
    for folder in iter(jobs.get, None):
        barrier.wait()
        try:
            open_and_log(f"sqlite:///{folder}/mlruns/mlflow.db", f"p{os.getpid()}")
            results.put("ok")
        except BaseException as e:  # every failure is the test's finding
            results.put(f"{type(e).__name__}: {e}")


@pytest.mark.slow
def test_processes_racing_to_create_a_fresh_store_never_fail(tmp_path):
    ctx = mp.get_context("spawn")  # fresh interpreters, as separate `python -m sweep` processes are
    barrier, jobs, results = ctx.Barrier(N_PROCESSES), ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=_open_and_log, args=(barrier, jobs, results)) for _ in range(N_PROCESSES)]
    for w in workers:
        w.start()
    folders = [tmp_path / f"rep{i}" for i in range(REPETITIONS)]
    for folder in folders:
        for _ in range(N_PROCESSES):
            jobs.put(folder)
    outcomes = [results.get(timeout=300) for _ in range(N_PROCESSES * REPETITIONS)]
    for _ in workers:
        jobs.put(None)
    for w in workers:
        w.join(timeout=60)
    assert outcomes == ["ok"] * len(outcomes), [o for o in outcomes if o != "ok"]
    for folder in folders:  # one store each, holding every process's run
        client = MlflowClient(f"sqlite:///{folder}/mlruns/mlflow.db")
        runs = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
        assert len(runs) == N_PROCESSES and {r.info.status for r in runs} == {"FINISHED"}


def _ranks_racing(root: Path, reps: int, *flags: str) -> list[str]:
    """``torchrun --nproc_per_node=2``: both ranks open each fresh store at once; their outcomes."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    res = subprocess.run(
        [*TORCHRUN, str(root), str(reps), *flags],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return [o for rank in (0, 1) for o in json.loads((root / f"outcomes-{rank}.json").read_text())]


@pytest.mark.slow
def test_torchrun_ranks_racing_to_create_a_fresh_store_never_fail(tmp_path):
    outcomes = _ranks_racing(tmp_path, REPETITIONS)
    assert outcomes == ["ok"] * (2 * REPETITIONS), [o for o in outcomes if o != "ok"]
    for i in range(REPETITIONS):
        client = MlflowClient(f"sqlite:///{tmp_path}/rep{i}/mlruns/mlflow.db")
        runs = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
        assert sorted(r.info.run_name for r in runs) == ["rank0", "rank1"]


@pytest.mark.slow
def test_the_race_test_catches_the_race_without_the_lock(tmp_path):
    """Control: the same ranks, the store left to MLflow to create (no lock, as before): they fail."""
    outcomes = _ranks_racing(tmp_path, 2, "--without-lock")
    failures = [o for o in outcomes if o != "ok"]
    assert failures, outcomes
    assert any(k in f for f in failures for k in ("already exists", "duplicate column", "locked")), failures


@pytest.mark.slow
def test_a_kill_while_creating_the_store_leaves_nothing_half_made(tmp_path):
    db = tmp_path / "mlruns" / "mlflow.db"
    code = f"from sweep.tracking.store import open_client; open_client('sqlite:///{db}')"
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 120
    while not list(db.parent.glob(".mlflow.db.creating-*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list(db.parent.glob(".mlflow.db.creating-*")), "the migration was not caught in progress"
    assert not db.exists()
    s = Store.open(f"sqlite:///{db}", "clipamp")  # the next run creates it and clears the leftover
    assert s.client.get_experiment(s.experiment_id).name == "clipamp"
    assert not list(db.parent.glob(".mlflow.db.creating-*"))


def _set_revision(db: Path, revision: str, keep_runs: bool) -> None:
    con = sqlite3.connect(db)
    con.execute("UPDATE alembic_version SET version_num = ?", (revision,))
    if not keep_runs:
        con.execute("DELETE FROM runs")
    con.commit()
    con.close()


def _with_one_run(uri: str) -> None:
    client = MlflowClient(uri)
    client.set_terminated(client.create_run(client.create_experiment("e")).info.run_id)


@pytest.mark.parametrize(
    "revision,keep_runs,expected",
    [
        ("ffffffffffff", True, "written by a newer MLflow"),
        ("0a8213491aaa", True, f"`{mlflow_command()} db upgrade sqlite:///"),  # older, with runs: upgrade it
        ("0a8213491aaa", False, "left half-created"),  # nothing in it: move it aside
    ],
)
def test_an_unusable_schema_names_the_repair(store, revision, keep_runs, expected):
    _with_one_run(store)
    _set_revision(Path(store[len("sqlite:///") :]), revision, keep_runs)
    with pytest.raises(UserError) as e:
        Store.open(store, "clipamp")
    assert expected in str(e.value) and "\n" not in str(e.value)


KILLED_WRITER = """
import os, signal, sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA cache_size=1")  # the change reaches the file: the journal is live
con.execute("BEGIN IMMEDIATE")
for i in range(200):
    con.execute(f"INSERT INTO tags(key, value, run_uuid) SELECT 'x{i}', 'y', run_uuid FROM runs")
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_store_whose_writer_was_killed_mid_write_opens_with_its_runs(store):
    """SIGKILL in the middle of an MLflow write leaves a hot journal; the store check rolls it back (as
    SQLite's next writer does) instead of calling the store broken and advising to move it aside."""
    _with_one_run(store)
    db = Path(store[len("sqlite:///") :])
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(db)], capture_output=True)
    assert killed.returncode == -signal.SIGKILL and db.with_name("mlflow.db-journal").stat().st_size > 0
    opened = Store.open(store, "clipamp")  # refused before: "is not an SQLite database ... move it aside"
    [run] = opened.client.search_runs([e.experiment_id for e in opened.client.search_experiments()])
    assert run.info.status == "FINISHED" and not [t for t in run.data.tags if t.startswith("x")]


def _http_server(root: Path) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    return proc, port


def _deleted_experiment(store_uri: str) -> None:
    client = MlflowClient(store_uri)
    client.delete_experiment(client.create_experiment("clipamp"))


@pytest.mark.slow
def test_store_problems_are_one_line_errors(tmp_path, store_template, capsys, monkeypatch):
    """Each broken store through the CLI's entry point: exit 2, one line with the fix, no traceback, store
    untouched. One as ``python -m sweep`` in a new process (the exit status Python gives), the others in this
    process (``run_cli_here``: no interpreter start-up, which is most of a refused command's seconds)."""
    import optuna

    cases = {  # name → (args, expected fragments)
        "junk": ([], ["is not an SQLite database", "mv "]),
        "text": ([], ["is not an SQLite database", "mv "]),
        "dir": ([], ["is a directory"]),
        "newer": ([], ["newer MLflow"]),
        "optuna": (["tracking.uri=sqlite:///mlruns/optuna.db"], ["Optuna study database"]),
        "empty_path": (["tracking.uri=sqlite:///"], ["names no database file"]),
        "proc": (["tracking.uri=sqlite:////proc/nope.db"], ["cannot write in /proc/"]),
        "no_name": (["tracking.experiment=''"], ["tracking.experiment='' is empty"]),
        "deleted": ([], ["was deleted", "mlflow experiments restore --experiment-id"]),
        "web": ([], ["is not an MLflow tracking server"]),
    }
    dirs = {name: tmp_path / name for name in cases}
    for d in dirs.values():
        (d / "mlruns").mkdir(parents=True)
    db = {name: d / "mlruns" / "mlflow.db" for name, d in dirs.items()}
    db["junk"].write_bytes(os.urandom(8192))
    db["text"].write_text("not a database\n")
    db["dir"].mkdir()
    for name in ("newer", "deleted"):
        shutil.copyfile(store_template, db[name])
    _with_one_run(f"sqlite:///{db['newer']}")
    _set_revision(db["newer"], "ffffffffffff", keep_runs=True)
    _deleted_experiment(f"sqlite:///{db['deleted']}")
    optuna.create_study(storage=f"sqlite:///{dirs['optuna']}/mlruns/optuna.db", study_name="s")
    web, port = _http_server(dirs["web"])
    cases["web"][0].append(f"tracking.uri=http://127.0.0.1:{port}")
    argv = {name: ["+experiment=train", *TINY, "steps=2", *args] for name, (args, _) in cases.items()}
    try:
        junk = start_cli(*argv["junk"], cwd=dirs["junk"])
        results = {
            name: run_cli_here(*args, cwd=dirs[name], capsys=capsys, monkeypatch=monkeypatch)
            for name, args in argv.items()
            if name != "junk"
        }
        results["junk"] = finish(junk)
    finally:
        web.terminate()
        web.wait()
    for name, (_, fragments) in cases.items():
        assert_one_line_error(results[name], *fragments)
    con = sqlite3.connect(dirs["optuna"] / "mlruns" / "optuna.db")  # MLflow added no table to it
    assert "experiments" not in {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
    client = MlflowClient(f"sqlite:///{db['deleted']}")
    assert client.search_runs([client.get_experiment_by_name("clipamp").experiment_id], run_view_type=3) == []
