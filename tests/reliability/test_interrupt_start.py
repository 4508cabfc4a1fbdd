"""Ctrl-C before any run exists: one line that says so (no traceback, no "resume=true"), exit 130."""

from __future__ import annotations

import signal
import time

import pytest

from tests.app.helpers import TINY
from tests.reliability.helpers import finish, start_cli

pytestmark = pytest.mark.slow


def _stderr_lines(res) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("script", [None, "clipamp"], ids=["python -m sweep", "clipamp"])
def test_ctrl_c_during_start_up_is_one_line(tmp_path, script):
    """The console script too: it imports its entry point's module before calling it, so that module is the
    light ``sweep.startup`` (it was ``sweep.__main__``, whose imports ran before the handler: a traceback)."""
    proc = start_cli("+experiment=train", *TINY, "steps=2", cwd=tmp_path, script=script)
    time.sleep(0.5)  # Python is up; the app's imports (torch, MLflow, Hydra) take seconds
    proc.send_signal(signal.SIGINT)
    res = finish(proc)
    assert res.returncode == 130, res.stderr[-2000:]
    assert _stderr_lines(res) == ["interrupted during start-up: no run was started, nothing to resume"]
    assert not (tmp_path / "mlruns").exists()


def test_ctrl_c_before_the_first_step_says_nothing_to_resume(tmp_path):
    marker = tmp_path / "constructing"
    proc = start_cli(
        "+experiment=train",
        *TINY,
        "steps=2",
        "model=custom",
        "model._target_=tests.reliability.slow_model.SlowInit",
        cwd=tmp_path,
        env={"CLIPAMP_TEST_MARKER": str(marker)},
    )
    deadline = time.time() + 240
    while not marker.exists():
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    res = finish(proc)
    assert res.returncode == 130, res.stderr[-2000:]
    lines = _stderr_lines(res)
    assert lines == ["interrupted: before the first step: no step ran, nothing to resume; re-run the same command"], (
        lines
    )
