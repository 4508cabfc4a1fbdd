"""Issue 12 item 8: a signal during the end-of-run phase (eval, artifacts, plots) never leaves the run
RUNNING, and the message says what happened."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.app.helpers import TINY

pytestmark = pytest.mark.slow

STEPS = 4
# a long end-of-run phase (2,000 held-out batches to evaluate, then the plots: seconds), so that
# signals sent 0.1 s apart both arrive inside it
RUN = ["+experiment=train", *TINY, f"steps={STEPS}", "data.eval_batches=2000", "tracking.plots=true"]


def _signal_in_end_phase(tmp: Path, store: str, signals: int) -> tuple[subprocess.CompletedProcess, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sweep", *RUN], cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    csv = None
    for line in proc.stdout:
        if line.startswith("steps.csv: "):
            csv = Path(line.split(": ", 1)[1].strip())
            break
    while not (csv.exists() and csv.read_text().count("\n") > STEPS):  # every step written: the end phase
        time.sleep(0.02)
    for _ in range(signals):
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), csv.parts[-3]


def test_one_signal_lets_the_end_of_run_phase_finish(tmp_path, store):
    p, run_id = _signal_in_end_phase(tmp_path, store, 1)
    assert p.returncode == 130 and "Traceback" not in p.stderr, p.stderr
    assert "during the end-of-run phase: it completed first; the run ended FINISHED" in p.stderr
    run = MlflowClient(store).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert {"final_loss", "eval_loss", "grad_norm_p95"} <= set(run.data.metrics)
    names = {a.path for a in MlflowClient(store).list_artifacts(run_id)}
    assert {"steps.csv", "config.yaml", "quantiles.json"} <= names


def test_a_second_signal_cuts_it_short_and_says_so(tmp_path, store):
    p, run_id = _signal_in_end_phase(tmp_path, store, 2)
    assert p.returncode == 130 and "Traceback" not in p.stderr, p.stderr
    assert "cut short by a second signal; the run ended KILLED: steps.csv holds every step" in p.stderr
    assert MlflowClient(store).get_run(run_id).info.status == "KILLED"
