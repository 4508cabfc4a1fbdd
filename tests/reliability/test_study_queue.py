"""Workers on one sqlite study take each enqueued trial once (``storage.serialize_sqlite``).

Four processes open one sqlite study as the app does, start together and pop its 40 enqueued trials,
ten each. Every worker must end cleanly, and every trial must run exactly once, with the parameters
it was enqueued with, and end COMPLETE (without ``serialize_sqlite``: docs/measurements.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from sweep.experiments.study.storage import open_storage
from tests.app.helpers import repo_pythonpath

pytestmark = pytest.mark.slow  # real worker processes

SCRIPT = Path(__file__).with_name("pop_trials.py")
WORKERS, EACH = 4, 10


def test_workers_started_together_pop_each_enqueued_trial_once(tmp_path):
    url = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="queue", storage=open_storage(url))
    for i in range(WORKERS * EACH):
        study.enqueue_trial({"x": float(i)})
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    start = time.time() + 8  # every worker has imported and opened the storage by then
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), url, str(start), str(EACH)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(WORKERS)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    got = sorted(n for out, _ in outs for n in json.loads(out))
    assert got == list(range(WORKERS * EACH))  # each trial popped by one worker
    trials = optuna.load_study(study_name="queue", storage=open_storage(url)).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * (WORKERS * EACH)
    assert [t.params["x"] for t in trials] == [float(t.number) for t in trials]
    assert [t.value for t in trials] == [t.params["x"] for t in trials]
