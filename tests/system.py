"""System programs some tests need (Debian packages that ``bash scripts/test`` installs with apt).

Where a program cannot be had, the test skips with a one-line reason naming the package, so the
run's summary (``pytest -ra``) says how many skipped and why; a skip is never counted as a pass.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def system_program(*names: str, package: str, search: str | None = None) -> str:
    """The path of the first of ``names`` on PATH (or matching the glob ``search``), else skip.

    Args:
        names: executable names to look for, in order of preference.
        package: the Debian package that provides them, named in the skip reason.
        search: a glob for installs outside PATH (PostgreSQL's ``/usr/lib/postgresql/*/bin/``).
    """
    for name in names:
        if found := shutil.which(name):
            return found
    if search:
        candidates = sorted(Path("/").glob(search.lstrip("/")))
        if candidates:
            return str(candidates[-1])
    pytest.skip(f"needs the Debian package {package} ({' / '.join(names)} not found): bash scripts/test installs it")
