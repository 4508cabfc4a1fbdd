"""``sweep.report --out`` onto a path it cannot write is one line (the table is printed first); a report
in a folder without a store says so and creates none."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.app.helpers import REPO, TINY, run_cli
from tests.reliability.helpers import assert_one_line_error

pytestmark = pytest.mark.slow


def _report(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sweep.report", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )


def test_report_in_an_empty_folder_creates_no_store(tmp_path):
    res = _report(cwd=tmp_path)
    assert res.returncode == 0 and "no runs yet: no tracking store at mlruns/mlflow.db" in res.stdout, res.stderr
    assert list(tmp_path.iterdir()) == []


def test_out_that_cannot_be_written_is_one_line(tmp_path):
    first = run_cli("+experiment=train", *TINY, "steps=1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    (tmp_path / "taken.md").mkdir()
    res = _report("--out", "taken.md", cwd=tmp_path)  # a folder has the file's name
    assert_one_line_error(res, "--out taken.md: not a writable file path")
    res = _report("--out", "/dev/full", cwd=tmp_path)  # the write itself fails
    assert_one_line_error(res, "--out /dev/full: cannot write /dev/full (No space left on device)")
    assert "clipamp" in res.stdout or "train" in res.stdout  # the table was printed before
