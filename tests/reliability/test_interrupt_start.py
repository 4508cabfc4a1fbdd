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


@pytest.mark.parametrize(
    "module, script, line",
    [
        ("sweep.report", None, "interrupted: the report was not finished"),
        ("sweep.recommend", None, "interrupted: the recommendation was not finished"),
        ("sweep.recommend", "clipamp-recommend", "interrupted: the recommendation was not finished"),
    ],
    ids=["python -m sweep.report", "python -m sweep.recommend", "clipamp-recommend"],
)
def test_ctrl_c_during_a_reading_tools_start_up_is_one_line(tmp_path, module, script, line):
    """The report and the recommendation import pandas, MLflow and torch for seconds before their own code runs:
    a Ctrl-C then was a traceback through whatever import was running."""
    args = ["--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"] if module == "sweep.report" else ["steps.csv"]
    proc = start_cli(*args, cwd=tmp_path, module=module, script=script)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    res = finish(proc)
    assert res.returncode == 130, res.stderr[-2000:]
    assert _stderr_lines(res) == [
        line + (" (it only reads the tracking store: nothing there changed)" * (module == "sweep.report"))
    ]
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_a_reading_tool_works_is_one_line(capsys):
    """After start-up, a Ctrl-C inside the tool (a slow store, a large log) is the same one line and exit 130."""
    from sweep.startup import exit_interruptible

    def main() -> int:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        exit_interruptible(main, "interrupted: the report was not finished")
    assert e.value.code == 130
    assert capsys.readouterr().err == "interrupted: the report was not finished\n"
