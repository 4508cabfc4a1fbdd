"""The README's test command is what CI runs, and tests that need a missing system program skip by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.system import system_program

ROOT = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
    """Shell lines of the ```bash blocks of a Markdown page, or of a script (comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S) or [text]
    lines = [ln.strip() for block in blocks for ln in block.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_ci_runs_the_readmes_test_command_and_nothing_else():
    readme = _commands((ROOT / "README.md").read_text())
    test_command = next(c for c in readme if "scripts/test" in c)
    ci = [c for c in _commands((ROOT / ".ci/run").read_text()) if not c.startswith(("set ", "cd "))]
    assert ci == [test_command] == ["bash scripts/test"]


def test_a_missing_program_skips_naming_its_package():
    with pytest.raises(
        pytest.skip.Exception, match="needs the Debian package nosuchpkg .*bash scripts/test installs it"
    ):
        system_program("clipamp-no-such-program", package="nosuchpkg", search="/nonexistent/*/bin/x")
