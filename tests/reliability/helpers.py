"""What every reliability test asserts about a failed invocation, and process plumbing."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.app.helpers import REPO


def assert_one_line_error(res, *fragments: str, status: int = 2) -> str:
    """Exit ``status``, no traceback, one ``error:`` line on stderr naming each of ``fragments``."""
    err = res.stderr if isinstance(res.stderr, str) else res.stderr.decode()
    assert res.returncode == status, (res.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err[-2000:]
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def start_cli(
    *args: str, cwd: Path, env: dict | None = None, module: str = "sweep", script: str | None = None
) -> subprocess.Popen:
    """``python -m sweep ARGS`` (or ``module``, or the console ``script`` beside this Python) in ``cwd`` with this
    tree's code, not waited for. Its SIGINT is as in a terminal, whatever pytest inherited: a suite started as
    a background job ignores SIGINT, and the app keeps an ignored SIGINT ignored (as ``nohup`` would want)."""
    full = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    full.update({"PYTHONPATH": str(REPO), **(env or {})})
    command = [str(Path(sys.executable).parent / script)] if script else [sys.executable, "-m", module]
    return subprocess.Popen(
        [*command, *args],
        cwd=cwd,
        env=full,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def finish(proc: subprocess.Popen, timeout: float = 600) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def open_and_log(uri: str, run_name: str) -> None:
    """Open (create, migrate) the store at ``uri`` through the app's one opening path and log one run."""
    from sweep.tracking.tracker import Store

    s = Store.open(uri, "clipamp")
    run = s.client.create_run(s.experiment_id, run_name=run_name)
    s.client.set_terminated(run.info.run_id)


def start_run(*args: str, cwd: Path, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """``start_cli`` up to the ``steps.csv: PATH`` line; the process and that path."""
    proc = start_cli(*args, cwd=cwd, env=env)
    for line in proc.stdout:
        if line.startswith("steps.csv: "):
            return proc, Path(line.split(": ", 1)[1].strip())
    raise AssertionError(proc.stderr.read())


def csv_steps(csv: Path) -> list[int]:
    """The steps of ``csv``'s complete rows (a torn last line left out)."""
    text = csv.read_text() if csv.exists() else ""
    return [int(line.split(",", 1)[0]) for line in text[: text.rfind("\n") + 1].splitlines()[1:]]


def kill_between_checkpoints(
    proc: subprocess.Popen, csv: Path, every: int, least: int, past: range = range(1, 4)
) -> int:
    """SIGKILL ``proc`` once ``csv`` holds >= ``least`` rows and its last step is ``past`` (1-3) steps past a
    multiple of ``every`` (after a checkpoint, not on one); the last step in the CSV."""
    import time

    deadline = time.time() + 240
    while len(steps := csv_steps(csv)) < least or steps[-1] % every not in past:
        assert time.time() < deadline and proc.poll() is None, f"{csv} did not reach {least} rows"
        time.sleep(0.005)
    proc.kill()
    proc.communicate(timeout=60)
    return csv_steps(csv)[-1]


@contextlib.contextmanager
def small_tmpfs(folder: Path, options: str, why: str) -> Iterator[Path]:
    """``folder`` as a tmpfs mounted with ``options`` (``size=3m``, ``ro,size=1m``) for the block, unmounted
    after it: a real full or read-only file system (root ignores permission bits, so chmod proves nothing).
    Skips with ``why`` without root or mount(8)."""
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip(f"needs root and mount(8) {why}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
