"""Issue 12 item 3: a run tracked on an `mlflow server`, stopped and resumed, keeps every step there."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from sweep.app import run
from tests.app.helpers import TINY, compose_cfg
from tests.app.run.test_mlflow_server import server  # noqa: F401

pytestmark = pytest.mark.slow

RUN = ["+experiment=train", *TINY, "seed=1", "optim.schedule=constant", "optim.warmup_steps=5"]


def test_sigterm_then_resume_on_a_server_keeps_all_rows(server, tmp_path, monkeypatch):  # noqa: F811
    uri, root = server
    proc = subprocess.Popen(
        [sys.executable, "-m", "sweep", *RUN, f"tracking.uri={uri}", "steps=100000", "checkpoint_every=0"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    csv = None
    for line in proc.stdout:
        if line.startswith("steps.csv: "):
            csv = Path(line.split(": ", 1)[1].strip())
            break
    while not (csv.exists() and csv.read_text().count("\n") > 10):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    client = MlflowClient(uri)
    run_id = next(
        r
        for e in client.search_experiments()
        for r in client.search_runs([e.experiment_id])
        if r.info.status == "KILLED"
    ).info.run_id
    uploaded = [p for p in (root / "artifacts").rglob("steps.csv") if run_id in str(p)]
    n = uploaded[0].read_text().count("\n") - 1  # the local temporary copy is removed once uploaded

    monkeypatch.chdir(tmp_path)  # the checkpoint of a server run lives under ./mlruns/checkpoints
    result = run(compose_cfg(*RUN, f"tracking.uri={uri}", f"steps={n + 4}", "resume=true"))
    assert result.run_id == run_id and client.get_run(run_id).info.status == "FINISHED"
    stored = [p for p in (root / "artifacts").rglob("steps.csv") if run_id in str(p)]
    assert len(stored) == 1
    steps = [int(l.split(",", 1)[0]) for l in stored[0].read_text().splitlines()[1:]]
    assert steps == list(range(1, n + 5))  # the server's copy holds every step, not the resumed tail
    assert len(result.records.rows) == n + 4  # the summary metrics come from all of them
