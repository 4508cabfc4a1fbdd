"""A sweep whose Optuna study lives in a real PostgreSQL server (started here, on 127.0.0.1)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from tests.app.helpers import TINY, run_cli
from tests.system import system_program

pytestmark = pytest.mark.slow  # end to end: real runs through the app

SECRET = "hunter2pg"


def _pg_bin(name: str) -> str:
    return system_program(name, package="postgresql", search=f"/usr/lib/postgresql/*/bin/{name}")


@pytest.fixture(scope="module")
def postgres():
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    as_user = [] if os.geteuid() != 0 else ["runuser", "-u", "postgres", "--"]  # postgres refuses root
    root = Path(tempfile.mkdtemp(prefix="clipamp-pg-"))  # not under pytest's 0700 root-only folders
    data, pwfile = root / "data", root / "pw"
    pwfile.write_text(SECRET + "\n")
    if as_user:
        shutil.chown(root, "postgres")
        shutil.chown(pwfile, "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = lambda *a: subprocess.run([*as_user, *a], check=True, capture_output=True, text=True)  # noqa: E731
    run(initdb, "-D", str(data), "-U", "clipamp", "--pwfile", str(pwfile), "-A", "scram-sha-256")
    run(
        pg_ctl,
        "-D",
        str(data),
        "-w",
        "-l",
        str(root / "log"),
        "-o",
        f"-p {port} -k {root} -c listen_addresses=127.0.0.1",
        "start",
    )
    try:
        yield f"postgresql://clipamp:{SECRET}@127.0.0.1:{port}/postgres"
    finally:
        run(pg_ctl, "-D", str(data), "-m", "fast", "stop")
        shutil.rmtree(root, ignore_errors=True)


def test_two_invocations_share_one_postgres_study_without_leaking_the_password(tmp_path, store, postgres):
    args = [
        "+experiment=sweep",
        *TINY,
        "steps=6",
        "study.anchor=null",
        "study.n_trials=2",
        f"study.storage={postgres}",
        "optim.warmup_steps=2",
    ]
    first, second = run_cli(*args, cwd=tmp_path), run_cli(*args, cwd=tmp_path)
    for res in (first, second):
        assert res.returncode == 0, res.stderr
        assert SECRET not in res.stdout + res.stderr
    storage = optuna.storages.RDBStorage(postgres.replace("postgresql://", "postgresql+psycopg2://"))
    (name,) = optuna.get_all_study_names(storage)
    trials = optuna.load_study(study_name=name, storage=storage).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    assert {t.params["dtype"] for t in trials} == {"fp16", "bf16"}
    client = MlflowClient(store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 2 + 4  # two parents, four children
    for run in runs:
        assert SECRET not in str(run.data.params) + str(run.data.tags)
    for f in (tmp_path / "mlruns" / "artifacts").rglob("*"):
        if f.is_file() and f.suffix in (".yaml", ".md", ".json", ".csv"):
            assert SECRET not in f.read_text(), f
