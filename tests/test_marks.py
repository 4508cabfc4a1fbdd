"""tests/conftest.py skips importing a module only when pytest itself would select none of its tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

from tests.conftest import pytest_ignore_collect

MODULES = {
    "test_all_slow.py": """
        pytestmark = pytest.mark.slow

        @pytest.mark.cuda
        def test_gpu(): pass

        def test_plain(): pass
    """,
    "test_slow_in_a_list.py": """
        pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

        def test_one(): pass
    """,
    "test_each_slow.py": """
        @pytest.mark.slow
        def test_one(): pass
    """,
    "test_marked_twice.py": """
        pytestmark = pytest.mark.slow
        pytestmark = pytest.mark.cuda

        def test_one(): pass
    """,
    "test_cuda.py": """
        pytestmark = pytest.mark.cuda

        def test_one(): pass

        @pytest.mark.slow
        def test_two(): pass
    """,
    "test_unmarked.py": """
        def test_one(): pass
    """,
}
EXPRESSIONS = ["not slow", "slow", "not cuda", "not slow or cuda", "not (slow or cuda)"]


def selected(tmp_path, markexpr: str) -> set[str]:
    """The modules with a test ``pytest -m markexpr`` selects, as pytest reports them."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", markexpr],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        timeout=60,
    )
    assert r.returncode in (0, 5), r.stdout + r.stderr
    return {line.split("::")[0] for line in r.stdout.splitlines() if "::" in line}


def test_a_module_is_skipped_only_where_pytest_selects_none_of_its_tests(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: s\n    cuda: c\n")
    for name, body in MODULES.items():
        (tmp_path / name).write_text("import pytest\n" + textwrap.dedent(body))
    skipped = {}
    for markexpr in EXPRESSIONS:
        config = SimpleNamespace(option=SimpleNamespace(markexpr=markexpr))
        skipped[markexpr] = {name for name in MODULES if pytest_ignore_collect(tmp_path / name, config)}
        assert not skipped[markexpr] & selected(tmp_path, markexpr), markexpr
    assert (
        skipped["not slow"]
        == skipped["not (slow or cuda)"] - {"test_cuda.py"}
        == {
            "test_all_slow.py",
            "test_slow_in_a_list.py",
        }
    )
    assert skipped["slow"] == skipped["not slow or cuda"] == set() and skipped["not cuda"] == {"test_cuda.py"}
    no_expression = SimpleNamespace(option=SimpleNamespace(markexpr=""))
    assert not any(pytest_ignore_collect(tmp_path / name, no_expression) for name in MODULES)
