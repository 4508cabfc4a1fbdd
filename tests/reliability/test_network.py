"""The app never reaches the network on its own: under an audit hook (``netaudit/sitecustomize.py``)
that logs and refuses every name lookup or connect outside 127.0.0.1, a whole calibrate, a sweep and
a ``model=custom`` run whose class loads a hub name try nothing, with CI/pytest markers (which make
MLflow switch its telemetry off by itself) removed from the environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.helpers import REPO, TINY
from tests.reliability.helpers import assert_one_line_error

pytestmark = pytest.mark.slow

AUDIT = Path(__file__).with_name("netaudit")
#: Environment variables that make MLflow (``mlflow.telemetry.utils``) or the hub libraries stay quiet by themselves.
QUIETING = ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "GITLAB_CI", "JENKINS_URL", "BUILDKITE", "DO_NOT_TRACK")


def _audited(*args: str, cwd: Path, log: Path) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in QUIETING and not k.startswith(("MLFLOW_", "HF_", "TRANSFORMERS_"))
    }
    env.update(PYTHONPATH=f"{AUDIT}{os.pathsep}{REPO}", CLIPAMP_NET_LOG=str(log))
    return subprocess.run(
        [sys.executable, "-m", "sweep", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_the_audit_hook_sees_a_connect(tmp_path):
    """The hook itself: a lookup of a public name is logged and refused."""
    log = tmp_path / "net.log"
    env = {**os.environ, "PYTHONPATH": str(AUDIT), "CLIPAMP_NET_LOG": str(log)}
    code = "import socket\ntry:\n    socket.getaddrinfo('example.org', 443)\nexcept ConnectionRefusedError:\n    pass"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert "socket.getaddrinfo 'example.org'" in log.read_text()


def test_calibrate_sweep_and_custom_runs_reach_no_host(tmp_path):
    log = tmp_path / "net.log"
    calibrate = _audited("+experiment=calibrate", *TINY, "steps=12", "calibrate.window=4", cwd=tmp_path, log=log)
    assert calibrate.returncode == 0, calibrate.stderr[-2000:]
    sweep = _audited(
        "+experiment=sweep", *TINY, "steps=4", "study.n_trials=2", "study.dtypes=[fp32]", cwd=tmp_path, log=log
    )
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    custom = _audited(
        "+experiment=train",
        *TINY,
        "steps=2",
        "model=custom",
        "model._target_=tests.reliability.hub_model.FromHub",
        cwd=tmp_path,
        log=log,
    )
    assert_one_line_error(custom, "tests.reliability.hub_model.FromHub")
    assert not log.exists(), log.read_text()
