"""The engine imports none of the app's libraries (it must stay usable in any torch loop)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import clipamp_engine

APP_LIBRARIES = ("hydra", "omegaconf", "optuna", "mlflow", "rich", "pandas")

_CHILD = textwrap.dedent("""
    import importlib, pkgutil, sys
    import clipamp_engine
    names = [m.name for m in pkgutil.walk_packages(clipamp_engine.__path__, "clipamp_engine.")]
    for name in names:
        importlib.import_module(name)
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1:]))
    print(len(names), " ".join(loaded))
""")


@pytest.mark.slow  # a fresh interpreter
def test_engine_and_every_submodule_import_no_app_library():
    root = Path(clipamp_engine.__file__).resolve().parents[1]  # the child imports this same package
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, *APP_LIBRARIES], capture_output=True, text=True, timeout=120, cwd=root
    )
    assert out.returncode == 0, out.stderr
    count, *loaded = out.stdout.split()
    assert int(count) >= 20  # every module was walked (clip/ included), not just the package
    assert loaded == [], f"the engine imported {loaded}"


#: The one engine module that imports numpy (diagnosis reads a CSV's columns through it).
NUMPY_USERS = {"norm_patterns.py"}


def test_the_engine_imports_torch_numpy_only_in_diagnosis_and_the_standard_library():
    """What README and engine.md say: torch only, numpy for the CSV diagnosis."""
    import ast

    root = Path(clipamp_engine.__file__).resolve().parent
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"clipamp_engine"}:
                found.setdefault(top, set()).add(str(path.relative_to(root)))
    assert set(found) == {"torch", "numpy"}, found
    assert found["numpy"] == NUMPY_USERS
