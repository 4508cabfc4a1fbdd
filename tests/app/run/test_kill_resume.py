"""Kill and resume with real subprocesses and signals: nothing completed is lost or repeated."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from tests.app.helpers import TINY, csv_of

pytestmark = pytest.mark.slow  # end to end: real runs through the app

ENV = {**{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}, "PYTHONUNBUFFERED": "1"}
# constant LR after warm-up: the cosine schedule's length follows `steps`, which the resumed and the
# uninterrupted runs set differently (the killed run had steps=100000)
RUN = ["+experiment=train", *TINY, "seed=1", "optim.schedule=constant", "optim.warmup_steps=5"]


def _start(tmp: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sweep", *RUN, *args],
        cwd=tmp,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:  # the path is printed as the run starts
        if line.startswith("steps.csv: "):
            return proc, Path(line.split(": ", 1)[1].strip())
    raise AssertionError(f"no steps.csv line; stderr: {proc.stderr.read()}")


def _wait_rows(csv: Path, n: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if csv.exists() and csv.read_text().count("\n") > n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{csv} did not reach {n} rows")


def _complete_steps(csv: Path) -> list[int]:
    text = csv.read_text()
    lines = text[: text.rfind("\n") + 1].splitlines()[1:]
    return [int(l.split(",", 1)[0]) for l in lines]


def _cli(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sweep", *RUN, *args], cwd=tmp, env=ENV, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_checkpoints_kills_run_and_resume_continues_exactly(tmp_path, store, sig):
    proc, csv = _start(tmp_path, "steps=100000", "checkpoint_every=0")
    _wait_rows(csv, 12)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "resume=true" in err and "Traceback" not in err
    steps = _complete_steps(csv)
    n = steps[-1]
    assert steps == list(range(1, n + 1))
    run_id = csv.parts[-3]
    client = MlflowClient(store)
    assert client.get_run(run_id).info.status == "KILLED"
    ckpt = tmp_path / "mlruns" / "checkpoints" / run_id / "checkpoint.pt"
    assert ckpt.exists()

    res = _cli(tmp_path, f"steps={n + 6}", "resume=true", "progress=true", "progress_every=2")
    assert res.returncode == 0, res.stderr
    assert f"resumed run {run_id} at step {n}" in res.stdout
    # progress counts the run's steps from the resume point on
    shown = [ln.split("  ")[1] for ln in res.stdout.splitlines() if "  loss " in ln and "|g|" in ln]
    assert shown[0] in (f"{n + 1}/{n + 6}", f"{n + 2}/{n + 6}") and shown[-1] == f"{n + 6}/{n + 6}", shown
    assert _complete_steps(csv) == list(range(1, n + 7))  # appended, nothing repeated or skipped
    assert client.get_run(run_id).info.status == "FINISHED" and not ckpt.exists()

    if sig != signal.SIGTERM:
        return  # one bitwise comparison is enough: both signals take the same path
    fresh = _cli(tmp_path, f"steps={n + 6}")  # the same run, never interrupted
    assert fresh.returncode == 0, fresh.stderr
    resumed, control = pd.read_csv(csv), pd.read_csv(csv_of(fresh.stdout))
    assert resumed["loss"].tolist() == control["loss"].tolist()  # bitwise the same trajectory
    assert resumed["grad_l2_pre_clip"].tolist() == control["grad_l2_pre_clip"].tolist()


def _report_of_killed(store: str, csv: Path, capsys) -> tuple[dict[str, str], dict[str, float], list[str]]:
    """``sweep.report --wide``'s row of the one (unfinished) run, numpy's figures over its steps.csv's complete
    rows (quantiles of the taken steps' finite norms, ratios, mean loss of the last 10 taken), the legend."""
    import io

    from sweep.report import cli

    assert cli.main(["--tracking-uri", store, "--wide"]) == 0
    head, row, *legend = capsys.readouterr().out.splitlines()
    cells = dict(zip(re.split(r"\s{2,}", head), re.split(r"\s{2,}", row)))
    text = csv.read_text()
    d = pd.read_csv(io.StringIO(text[: text.rfind("\n") + 1]))
    taken = d[~d["skipped"]]
    norms = taken["grad_l2_pre_clip"][np.isfinite(taken["grad_l2_pre_clip"])]
    p50, p95, p99 = np.quantile(norms, [0.5, 0.95, 0.99])
    loss = taken["loss"][np.isfinite(taken["loss"])].tail(10).mean()
    expected = {"p50": p50, "p95": p95, "p99": p99, "τ rec.": p95, "clipped": taken["clipped"].mean(), "loss": loss}
    return cells, expected, legend


def test_sigkill_keeps_consecutive_rows_and_resumes_from_last_checkpoint(tmp_path, store, capsys):
    proc, csv = _start(tmp_path, "steps=100000", "checkpoint_every=5")
    _wait_rows(csv, 13)
    proc.kill()
    proc.wait(timeout=60)
    steps = _complete_steps(csv)
    assert steps == list(range(1, steps[-1] + 1)) and len(steps) >= 13
    # sweep.report: the figures of its steps so far (before: — in every column), the run said dead, resumable
    cells, expected, legend = _report_of_killed(store, csv, capsys)
    shown = {k: float(cells[k].rstrip("%")) / (100 if cells[k].endswith("%") else 1) for k in expected}
    assert shown == pytest.approx(expected, rel=5e-4, abs=5e-4)  # 4 significant digits, one decimal of %
    assert cells["run"] == "train-gpt-bf16*" and cells["status"] == "RUNNING"
    run_id = csv.parts[-3]
    assert legend[1] == (
        f"  train-gpt-bf16 {run_id[:8]}: RUNNING in the store, but its process is gone (its run.lock is free: "
        f"killed, e.g. SIGKILL): {len(steps)} of 100000 steps; resumable: its command plus resume={run_id}"
    )
    res = _cli(tmp_path, f"steps={steps[-1] + 3}", "resume=true")
    assert res.returncode == 0, res.stderr
    resumed_at = int(res.stdout.split(" at step ")[1].split()[0])
    assert resumed_at % 5 == 0 and resumed_at <= steps[-1]
    assert _complete_steps(csv) == list(range(1, steps[-1] + 4))


def test_resume_without_checkpoint_is_a_one_line_error(tmp_path, store):
    res = _cli(tmp_path, "steps=3", "resume=true")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("error: resume=true: no run named")
    assert "with a checkpoint in experiment 'clipamp'; start a new run" in res.stderr  # its name, not its id
