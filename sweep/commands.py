"""The commands the app prints for a user to paste: they must run in the user's shell as it is.

After the README's set-up the project lives in ``.venv`` and nothing is activated, so a bare
``python`` is the system's (without clipamp: "No module named sweep") or absent (Debian ships only
``python3``), and a bare ``mlflow`` is "command not found". Each command names this environment's
program by its bare name only when the shell's ``PATH`` finds that very program, and by its path
otherwise.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path


def _program(name: str) -> str:
    """``name`` when the shell's ``PATH`` finds this environment's ``name``, else its quoted path."""
    own = Path(sys.executable).absolute().parent / name  # not resolved: a venv's python links out of it
    found = shutil.which(name)
    if not own.exists() or (found is not None and Path(found).absolute().parent == own.parent):
        return name
    return shlex.quote(str(own))


def mlflow_command() -> str:
    """The ``mlflow`` of this environment, as a pasted command names it."""
    return _program("mlflow")


def python_command(module: str) -> str:
    """``python -m MODULE`` with this environment's ``python`` (``.venv/bin/python`` when not activated)."""
    own = Path(sys.executable).absolute()
    return f"{_program('python' if (own.parent / 'python').exists() else own.name)} -m {module}"
