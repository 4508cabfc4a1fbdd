"""A real ``mlflow server`` for tests: 127.0.0.1, a free port, one worker, no job runner; its process
group started, awaited and stopped (or killed, as in a crash) at will."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


class MlflowServer:
    """``mlflow server --backend-store-uri store`` (``artifacts``: with ``--artifacts-destination``), run in ``cwd``."""

    def __init__(self, store: str, cwd: Path, artifacts: Path | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.store, self.cwd, self.artifacts = store, cwd, artifacts
        self.uri, self.proc = f"http://127.0.0.1:{self.port}", None

    def start(self, wait_s: float | None = 120) -> None:
        """Start it; ``wait_s``: then wait that long for it to answer (``None``: return at once, see ``wait``)."""
        self.cwd.mkdir(parents=True, exist_ok=True)
        served = ["--artifacts-destination", str(self.artifacts)] if self.artifacts else []
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", self.store, *served]
            + ["--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            cwd=self.cwd,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        if wait_s is not None:
            self.wait(wait_s)

    def wait(self, timeout_s: float = 120) -> None:
        """Until ``/health`` answers; the test fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.uri + "/health", timeout=1).read()
                return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"mlflow server did not answer within {timeout_s:g} s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Signal the server and its workers (its process group), then reap it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=60)

    def kill(self) -> None:
        """SIGKILL: a crash, no goodbye."""
        self.stop(signal.SIGKILL)
