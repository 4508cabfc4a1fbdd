"""Issue 12 item 17 and the printed ``steps.csv`` path of an uploaded run.

A real ``mlflow server`` on 127.0.0.1, killed (SIGKILL) while a run trains against it. The run goes
on; one warning line; no traceback. If the server is back before the run's end-of-run wait ends, the
run ends FINISHED on it with every step's metrics once and its artifacts. If it is not, the run's
folder keeps ``pending.json`` and the artifacts, one line names ``python -m sweep.resend DIR``, and
that command, once the server is back, completes the run on it. The ``steps.csv:`` path printed at
the start is a stable local path; once uploaded, the end line says where the file went."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.app.helpers import REPO, TINY
from tests.mlflow_server import MlflowServer
from tests.reliability.helpers import finish, start_cli

pytestmark = pytest.mark.slow  # real servers, real runs

STEPS = 300
RUN = [
    "+experiment=train",
    *TINY,
    f"steps={STEPS}",
    "tracking.flush_every=1",  # a send per step while the server answers: neither run can end before both train
    "optim.schedule=constant",
    "optim.warmup_steps=2",
]


def _server(root: Path) -> MlflowServer:
    """``mlflow server`` on a fixed port and folder (sqlite store, served artifacts), started and killed at will."""
    return MlflowServer(f"sqlite:///{root}/db.sqlite", root, artifacts=root / "artifacts")


def _start_run(tmp_path: Path, server: MlflowServer, *extra: str):
    """Start a run on ``server``, not waited for (see ``_csv_path``)."""
    return start_cli(*RUN, f"tracking.uri={server.uri}", *extra, cwd=tmp_path)


def _csv_path(proc) -> Path:
    """The steps.csv path a run printed first."""
    line = proc.stdout.readline()
    assert line.startswith("steps.csv: "), line + proc.stderr.read()[-2000:]
    return Path(line.split(": ", 1)[1].strip())


def _rows(csv_path: Path) -> list[int]:
    with open(csv_path, newline="") as f:
        return [int(r["step"]) for r in csv.DictReader(f)]


def _assert_complete_on_server(uri: str, run_id: str) -> None:
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and "final_loss" in run.data.metrics
    steps = [m.step for m in client.get_metric_history(run_id, "loss")]
    assert sorted(steps) == list(range(1, STEPS + 1))  # every step once: nothing lost, nothing doubled
    assert {"steps.csv", "config.yaml"} <= {a.path for a in client.list_artifacts(run_id)}
    assert _rows(Path(client.download_artifacts(run_id, "steps.csv"))) == list(range(1, STEPS + 1))


def _warnings(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("warning: the tracking server")]


def test_runs_outlive_their_tracking_server(tmp_path):
    """Two runs on one server killed mid-run: one waits at its end until the server is back (and completes
    on it), the other does not wait (its folder keeps what was not sent, and sweep.resend sends it)."""
    server = _server(tmp_path / "server")
    server.start()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(REPO)
    resend = [sys.executable, "-m", "sweep.resend"]
    try:
        # started together, so that one cannot train all its steps while the other starts up
        waits = _start_run(tmp_path, server, "tracking.reconnect_s=600")
        away = _start_run(tmp_path, server, "tracking.reconnect_s=1")
        waits_csv, away_csv = _csv_path(waits), _csv_path(away)
        for csv_path in (waits_csv, away_csv):  # a stable local path
            assert csv_path.parent == tmp_path / "mlruns" / "uploads" / csv_path.parent.name
        while min(p.read_text().count("\n") if p.exists() else 0 for p in (waits_csv, away_csv)) <= 40:
            assert waits.poll() is None and away.poll() is None
            time.sleep(0.05)
        server.kill()

        res = finish(away)  # the server is still down when this run ends
        assert res.returncode == 0, res.stderr[-3000:]
        folder = away_csv.parent
        lines = _warnings(res.stderr)
        assert len(lines) == 2 and "stopped answering" in lines[0], lines
        assert f"kept in {folder}" in lines[1] and f"python -m sweep.resend {folder}" in lines[1]
        assert (folder / "pending.json").exists() and _rows(away_csv) == list(range(1, STEPS + 1))
        failed = subprocess.run([*resend, str(folder)], capture_output=True, text=True, env=env, timeout=120)
        assert failed.returncode != 0 and "Traceback" not in failed.stderr, failed.stderr[-2000:]
        assert len([x for x in failed.stderr.splitlines() if x.startswith("error:")]) == 1, failed.stderr
        assert (folder / "pending.json").exists()  # nothing lost by a re-send that found no server

        server.start()  # back: the waiting run completes on it, the other is sent
        res = finish(waits)
        assert res.returncode == 0, res.stderr[-3000:]
        assert len(_warnings(res.stderr)) == 1  # stopped answering; then it answered again
        run_id = waits_csv.parent.name
        _assert_complete_on_server(server.uri, run_id)
        assert not waits_csv.parent.exists()  # uploaded: the local copy went, and the end line says where
        assert any(
            line.startswith("steps.csv: uploaded to mlflow-artifacts:/") and run_id in line
            for line in res.stdout.splitlines()
        ), res.stdout[-2000:]
        sent = subprocess.run([*resend, str(folder)], capture_output=True, text=True, env=env, timeout=120)
        assert sent.returncode == 0, sent.stderr[-2000:]
        _assert_complete_on_server(server.uri, folder.name)
        assert folder.name in sent.stdout and not folder.exists()
        for out in (res.stdout, sent.stdout):  # the app's own run lines, not MLflow's "🏃 View run …" before them
            assert "View run" not in out and "View experiment" not in out, out[-2000:]
    finally:
        server.kill()
