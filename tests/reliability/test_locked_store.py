"""A sqlite store another process holds locked (an open `sqlite3` transaction, a backup): at start one line
saying so (not "not an SQLite database, move it aside", which would hide a valid store's runs); mid-run one
line, the run's checkpoint and steps.csv kept, and `resume=true` then equals an uninterrupted run step for step."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from sweep.tracking.busy import LOCK_WAIT_S
from tests.app.helpers import TINY, run_cli, store_in
from tests.reliability.helpers import assert_one_line_error, csv_steps, finish, start_run

pytestmark = pytest.mark.slow  # each waits out MLflow's 20 s lock timeout

RUN = ["+experiment=train", *TINY, "seed=1", "optim.schedule=constant", "optim.warmup_steps=5"]

HOLD = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()  # held until the test closes stdin
con.execute("COMMIT")
"""


def hold_lock(db: Path) -> subprocess.Popen:
    """A process holding ``db``'s write lock (``BEGIN EXCLUSIVE``) until its stdin is closed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"locked"
    return proc


def release(holder: subprocess.Popen) -> None:
    holder.stdin.close()
    assert holder.wait(timeout=30) == 0


def test_a_store_locked_at_start_is_named_locked_and_left_alone(tmp_path, store_template):
    uri = store_in(tmp_path, store_template)
    db = tmp_path / "mlruns" / "mlflow.db"
    before = db.read_bytes()
    holder = hold_lock(db)
    try:
        res = run_cli(*RUN, "steps=2", f"tracking.uri={uri}", cwd=tmp_path)
    finally:
        release(holder)
    line = assert_one_line_error(res, "locked by another process", str(db))
    assert "not an SQLite database" not in line and "mv " not in line, line
    assert db.read_bytes() == before


def test_a_store_locked_mid_run_stops_it_resumably_in_one_line(tmp_path, store_template):
    uri = store_in(tmp_path, store_template)
    db = tmp_path / "mlruns" / "mlflow.db"
    proc, csv = start_run(*RUN, "steps=100000", "checkpoint_every=5", f"tracking.uri={uri}", cwd=tmp_path)
    while len(csv_steps(csv)) < 8:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.01)
    holder = hold_lock(db)
    t0 = time.time()
    try:
        res = finish(proc)
    finally:
        release(holder)
    assert time.time() - t0 >= LOCK_WAIT_S - 1  # it waited for the lock first
    assert_one_line_error(res, "stayed locked by another process", "resume=true", status=1)
    run_id = csv.parts[-3]
    # still locked as it ended: its end could not be recorded (KILLED when the store answers by then)
    assert MlflowClient(uri).get_run(run_id).info.status == "RUNNING"
    assert (tmp_path / "mlruns" / "checkpoints" / run_id / "checkpoint.pt").exists()

    steps = csv_steps(csv)[-1] + 5
    resumed = run_cli(*RUN, f"steps={steps}", "checkpoint_every=5", f"tracking.uri={uri}", "resume=true", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    ref = run_cli(*RUN, f"steps={steps}", f"tracking.uri={store_in(ref_dir, store_template)}", cwd=ref_dir)
    assert ref.returncode == 0, ref.stderr[-2000:]
    (ref_csv,) = ref_dir.glob("mlruns/artifacts/*/*/artifacts/steps.csv")
    assert csv.read_text() == ref_csv.read_text()  # every step once, the same numbers
    history = MlflowClient(uri).get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))
