"""Stores that used to hang, land elsewhere or be damaged: an unreachable database server is one line
within seconds; a run folder whose path holds ``?`` or ``%20`` keeps its store inside it; a study
storage that is the tracking store is refused before Optuna touches it."""

from __future__ import annotations

import sqlite3
import sys
import time

import pytest

from tests.app.helpers import TINY, run_cli, store_in
from tests.reliability.helpers import assert_one_line_error

pytestmark = pytest.mark.slow

DEAD = "postgresql://bob:S1cret@127.0.0.1:1/clipamp"


@pytest.mark.parametrize("how", ["override", "env", "report"])
def test_unreachable_database_store_is_one_line(tmp_path, how):
    """Through each way of naming the store; how long it takes is checked in-process below, where neither the
    interpreter's start-up nor a loaded machine's wait for a core counts."""
    if how == "report":
        import subprocess

        res = subprocess.run(
            [sys.executable, "-m", "sweep.report", "--tracking-uri", DEAD], cwd=tmp_path, capture_output=True, text=True
        )
    elif how == "env":
        res = run_cli("+experiment=train", *TINY, "steps=2", cwd=tmp_path, env={"MLFLOW_TRACKING_URI": DEAD})
    else:
        res = run_cli("+experiment=train", *TINY, "steps=2", f"tracking.uri={DEAD}", cwd=tmp_path)
    line = assert_one_line_error(res, "postgresql://bob:***@127.0.0.1:1/clipamp", "is unreachable")
    assert "S1cret" not in res.stdout + res.stderr, line
    if how == "report":  # the report's own option, not the runner's override
        assert "--tracking-uri 'postgresql://" in line, line
        assert "tracking.uri" not in line.replace("--tracking-uri", ""), line


def test_unreachable_database_store_is_refused_in_seconds():
    """One connection attempt, not MLflow's ~100 s of retries (a refused connection answers at once)."""
    from sweep.errors import UserError
    from sweep.tracking.tracker import Store

    started = time.monotonic()
    with pytest.raises(UserError, match="is unreachable"):
        Store.open(DEAD, "clipamp")
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("name", ["run?q", "run%20dir"])
def test_run_folder_with_url_characters_keeps_its_store(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    res = run_cli("+experiment=train", *TINY, "steps=2", cwd=folder)
    assert res.returncode == 0, res.stderr[-2000:]
    db = folder / "mlruns" / "mlflow.db"
    con = sqlite3.connect(db)
    assert con.execute("SELECT status FROM runs").fetchall() == [("FINISHED",)]
    con.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing beside the folder (no stray `q`)
    assert list(folder.glob("mlruns/artifacts/clipamp/*/artifacts/steps.csv"))


def test_study_storage_that_is_the_tracking_store_is_refused_untouched(tmp_path, store_template):
    store_in(tmp_path, store_template)  # the tracking store exists (the default one for cwd=tmp_path)
    db = tmp_path / "mlruns" / "mlflow.db"

    def tables():
        con = sqlite3.connect(db)
        try:
            return sorted(r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'"))
        finally:
            con.close()

    before = tables()
    res = run_cli("+experiment=sweep", *TINY, "steps=2", "study.storage=sqlite:///mlruns/mlflow.db", cwd=tmp_path)
    assert_one_line_error(res, "study.storage='sqlite:///mlruns/mlflow.db' is the tracking store")
    assert tables() == before and "studies" not in before
