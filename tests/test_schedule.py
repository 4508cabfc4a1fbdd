"""The files reach pytest-xdist's workers with the most slow tests first (tests/schedule.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUITE = {
    "test_fast.py": "def test_a(): pass\ndef test_b(): pass\ndef test_c(): pass\n",
    "test_one_slow.py": "import pytest\n\n@pytest.mark.slow\ndef test_x(): pass\ndef test_y(): pass\n",
    "test_two_slow.py": "import pytest\npytestmark = pytest.mark.slow\n\ndef test_p(): pass\ndef test_q(): pass\n",
    "test_other_fast.py": "def test_m(): pass\n",
}


def _collected(folder: Path, *args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_files_with_more_slow_tests_come_first_each_file_whole_and_in_order(tmp_path):
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    conftest = "from tests.schedule import slow_first\n\ndef pytest_collection_modifyitems(items):\n"
    (tmp_path / "conftest.py").write_text(conftest + "    items[:] = slow_first(items)\n")
    (tmp_path / "pytest.ini").write_text(f"[pytest]\nmarkers = slow\npythonpath = {ROOT}\n")
    plain = _collected(tmp_path, "-p", "no:xdist", "--noconftest")
    assert [n.split("::")[0] for n in plain][::2] == [
        "test_fast.py",
        "test_fast.py",
        "test_one_slow.py",
        "test_two_slow.py",
    ]
    ordered = _collected(tmp_path, "-p", "no:xdist")
    assert ordered == [
        *[n for n in plain if n.startswith("test_two_slow.py")],  # two slow tests
        *[n for n in plain if n.startswith("test_one_slow.py")],  # one
        *[n for n in plain if n.startswith("test_fast.py")],  # none: then by count of tests
        *[n for n in plain if n.startswith("test_other_fast.py")],
    ]
    assert _collected(tmp_path, "-p", "no:xdist") == ordered  # the same in every process


def test_the_suites_conftest_puts_slow_files_first():
    """Named fast file first, all-slow file second: this suite's conftest hands out the slow one first."""
    names = _collected(ROOT, "-p", "no:xdist", "tests/test_marks.py", "tests/app/test_packaging.py")
    files = list(dict.fromkeys(n.split("::")[0] for n in names))
    assert files == ["tests/app/test_packaging.py", "tests/test_marks.py"]


def test_scripts_test_keeps_the_collection_order():
    """Without ``--no-loadscope-reorder`` xdist hands the files out by their count of tests instead."""
    command = (ROOT / "scripts" / "test").read_text().strip().splitlines()[-1]
    assert re.search(r"--dist loadfile --no-loadscope-reorder ", command), command
