"""Issue 12 item 4: a run cannot be resumed twice at once, and no resume duplicates metric history."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from mlflow import MlflowClient

from sweep.app import run
from sweep.errors import UserError
from tests.app.helpers import TINY, compose_cfg

pytestmark = pytest.mark.slow

RUN = [
    "+experiment=train",
    *TINY,
    "seed=1",
    "optim.schedule=constant",
    "optim.warmup_steps=5",
    "tracking.flush_every=1",
]


def _start(tmp: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sweep", *RUN, *args], cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in proc.stdout:
        if line.startswith("steps.csv: "):
            return proc, Path(line.split(": ", 1)[1].strip())
    raise AssertionError(proc.stderr.read())


def _rows(csv: Path) -> list[int]:
    text = csv.read_text() if csv.exists() else ""
    return [int(l.split(",", 1)[0]) for l in text[: text.rfind("\n") + 1].splitlines()[1:]]


def _wait(csv: Path, n: int, *, between_checkpoints: int = 0) -> None:
    """Until `csv` has `n` rows; with `between_checkpoints=k`, also until its last step is 2 or 3
    past a multiple of k, so a kill that follows lands after a checkpoint, not on one."""
    deadline = time.time() + 240
    while len(rows := _rows(csv)) < n or (between_checkpoints and rows[-1] % between_checkpoints not in (2, 3)):
        assert time.time() < deadline, f"{csv} did not reach {n} rows"
        time.sleep(0.005)


def test_second_resume_is_refused_and_history_has_no_duplicates(tmp_path, store):
    first, csv = _start(tmp_path, "steps=100000", "checkpoint_every=5")
    _wait(csv, 13, between_checkpoints=5)
    first.kill()  # SIGKILL: rows past the checkpoint at step 10 or more were already written
    first.wait(timeout=60)
    killed_at = _rows(csv)[-1]
    run_id = csv.parts[-3]
    client = MlflowClient(store)  # their metrics wait for the next checkpoint: the resume trains them again
    assert max(m.step for m in client.get_metric_history(run_id, "loss")) == killed_at - killed_at % 5

    resumed, _ = _start(tmp_path, "steps=100000", "checkpoint_every=5", "resume=true")
    try:
        _wait(csv, killed_at + 3)
        with pytest.raises(UserError) as e:  # the same run, resumed again while the first resume trains
            run(compose_cfg(*RUN, f"tracking.uri={store}", "steps=100000", "resume=true"))
        assert str(e.value).startswith(f"resume={run_id}: the run is in use by another process")
        assert client.get_run(run_id).info.status == "RUNNING"  # untouched by the refused resume
    finally:
        resumed.send_signal(signal.SIGTERM)
        _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 130, err
    steps = _rows(csv)
    assert steps == list(range(1, steps[-1] + 1))  # every step once
    for name in ("loss", "lr", "grad_l2_pre_clip"):
        history = Counter(m.step for m in client.get_metric_history(run_id, name))
        assert sorted(history) == steps and set(history.values()) == {1}, name  # no duplicated step
    assert client.get_run(run_id).info.status == "KILLED"
