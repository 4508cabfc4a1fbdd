"""SIGKILL then ``resume=true``: MLflow's per-step history holds every step of ``steps.csv`` exactly
once with the CSV's values; a refused resume leaves ``steps.csv`` byte for byte as it was."""

from __future__ import annotations

import csv as csvlib
import hashlib
import sqlite3

import pytest
import torch
from mlflow import MlflowClient

from tests.app.helpers import TINY
from tests.reliability.helpers import assert_one_line_error, finish, kill_between_checkpoints, start_cli, start_run

pytestmark = pytest.mark.slow

RUN = ["+experiment=train", *TINY, "seed=1", "optim.schedule=constant", "checkpoint_every=10"]
STEP_METRICS = ("loss", "grad_l2_pre_clip", "grad_l2_post_clip", "lr", "scaler_scale")


@pytest.fixture
def killed(tmp_path, store):
    """A train run SIGKILLed 1-3 steps past a checkpoint (default ``tracking.flush_every``):
    (folder, uri, run id, csv, last step written)."""
    proc, csv = start_run(*RUN, f"tracking.uri={store}", "steps=100000", cwd=tmp_path)
    last = kill_between_checkpoints(proc, csv, 10, 11)
    return tmp_path, store, csv.parts[-3], csv, last


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_history_holds_every_csv_step_once_after_kill_and_resume(killed):
    tmp, uri, run_id, csv, last = killed
    db = sqlite3.connect(uri.removeprefix("sqlite:///"))
    with db:  # the store lacks steps 1-5 the CSV holds (sends a kill cut short), and holds 6.. already
        db.execute("DELETE FROM metrics WHERE run_uuid = ? AND step <= 5", (run_id,))
    db.close()
    res = finish(start_cli(*RUN, f"tracking.uri={uri}", f"steps={last + 12}", "resume=true", cwd=tmp))
    assert res.returncode == 0, res.stderr[-2000:]
    with open(csv, newline="") as f:
        rows = list(csvlib.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, last + 13))
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    for key in STEP_METRICS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(int(r["step"]), float(r[key])) for r in rows], key


def test_refused_resume_leaves_steps_csv_byte_identical(killed):
    """A checkpoint that no longer fits the model: refused in one line, exit 2, the CSV untouched
    (13 rows stay 13, not cut back to the checkpoint's 10)."""
    tmp, uri, run_id, csv, last = killed
    ckpt_path = tmp / "mlruns" / "checkpoints" / run_id / "checkpoint.pt"
    ckpt = torch.load(ckpt_path, weights_only=False)
    name = next(k for k, v in ckpt["engine"]["model"].items() if v.dim() == 2)
    ckpt["engine"]["model"][name] = torch.zeros(3, 3)
    torch.save(ckpt, ckpt_path)
    before = _digest(csv)
    res = finish(start_cli(*RUN, f"tracking.uri={uri}", "steps=40", "resume=true", cwd=tmp))
    assert_one_line_error(res, f"resume={run_id}: the checkpoint does not fit this model")
    assert _digest(csv) == before and csv.read_text().count("\n") == last + 1
    assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"


def test_resume_without_steps_csv_is_refused_and_writes_none(killed):
    tmp, uri, run_id, csv, last = killed
    csv.unlink()
    res = finish(start_cli(*RUN, f"tracking.uri={uri}", "steps=40", "resume=true", cwd=tmp))
    assert_one_line_error(res, f"resume={run_id}: {csv} is missing")
    assert not csv.exists()


def test_resume_with_more_steps_replaces_the_killed_attempts_later_steps(tmp_path, store):
    """Steps after the latest checkpoint (sent at once: ``tracking.flush_every=1``) run again on resume, under
    the raised ``steps=``'s cosine LR (past the warm-up): MLflow must hold the resumed values, each once."""
    run = [
        "+experiment=train",
        *TINY,
        "seed=1",
        "optim.warmup_steps=2",
        "checkpoint_every=10",
        "tracking.flush_every=1",
    ]
    proc, csv = start_run(*run, f"tracking.uri={store}", "steps=40", cwd=tmp_path)
    last = kill_between_checkpoints(proc, csv, 10, 14, past=range(4, 9))  # steps 11.. sent before the kill
    res = finish(start_cli(*run, f"tracking.uri={store}", "steps=60", "resume=true", cwd=tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    with open(csv, newline="") as f:
        rows = list(csvlib.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 61)) and last % 10 >= 4
    client = MlflowClient(store)
    for key in STEP_METRICS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(csv.parts[-3], key))
        assert history == [(int(r["step"]), float(r[key])) for r in rows], key
