"""Docs that cannot rot: every command a page shows composes against conf/, every runnable snippet
runs, every relative link and image resolves. A deliberately broken page shows the checks can fail."""

from __future__ import annotations

import os
import runpy
import sys

import pytest
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from tests.app.helpers import compose_cfg
from tests.docs.pages import (
    ROOT,
    broken_links,
    invocations,
    overrides,
    pages,
    parses,
    runnable_snippets,
    script_parses,
    snippet_is_slow,
)

ALL = [inv for page in pages() for inv in invocations(page)]


def check(inv) -> None:
    """One invocation: its overrides compose (app), or its arguments parse (report, recommend, demo,
    benches, scripts)."""
    if inv.program.startswith(("bench/", "scripts/")):
        script_parses(inv.program, list(inv.args))
    elif inv.program == "sweep":
        compose_cfg(*overrides(inv.args))
    elif inv.program == "sweep.report":
        from sweep.report.cli import main

        parses(main, list(inv.args))
    elif inv.program == "sweep.recommend":
        from sweep.recommend.cli import main

        parses(main, list(inv.args))
    else:
        from clipamp_engine.demo import main

        parses(main, list(inv.args))


def test_the_pages_show_commands():
    programs = {inv.program for inv in ALL}
    assert {"sweep", "sweep.report"} <= programs and len(ALL) >= 10, [i.where() for i in ALL]


#: Each ``sweep`` command is a Hydra compose (~0.1 s, some 70 of them): the first on each page stays in the fast
#: subset, the rest are slow. The other programs only parse their arguments: all of them stay.
FIRST_SWEEP = {inv.page: inv for inv in reversed(ALL) if inv.program == "sweep"}
COMMANDS = [
    pytest.param(inv, marks=pytest.mark.slow if inv.program == "sweep" and FIRST_SWEEP[inv.page] is not inv else ())
    for inv in ALL
]


@pytest.mark.parametrize("inv", COMMANDS, ids=lambda inv: inv.where()[:90])
def test_every_command_composes(inv):
    check(inv)


def test_a_command_naming_a_missing_key_fails(tmp_path):
    page = tmp_path / "README.md"
    (tmp_path / "docs").mkdir()
    page.write_text("Run:\n\n```bash\nclipamp +experiment=calibrate calibrate.no_such_key=3\n```\n")
    (inv,) = invocations(page)
    with pytest.raises((HydraException, OmegaConfBaseException), match="no_such_key"):
        check(inv)


def test_a_command_naming_a_missing_choice_fails(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("`python -m sweep +experiment=train model=no_such_model`\n")
    (inv,) = invocations(page)
    with pytest.raises(HydraException, match="no_such_model"):
        check(inv)


@pytest.mark.parametrize(
    "program", ["bench/bench_startup.py", "scripts/gpu_wheels.py", "-m sweep.report"], ids=["bench", "script", "report"]
)
def test_a_flag_that_does_not_exist_fails(tmp_path, program):
    page = tmp_path / "p.md"
    page.write_text(f"```bash\n.venv/bin/python {program} --no-such-flag\n```\n")
    (inv,) = invocations(page)
    with pytest.raises(SystemExit) as e:
        check(inv)
    assert e.value.code == 2


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_links_and_images_resolve(page):
    assert broken_links(page) == []


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("See [the page](docs/missing.md) and ![fig](docs/fig.png), [ok](https://x.org).\n")
    assert broken_links(page) == ["README.md: docs/missing.md", "README.md: docs/fig.png"]


SNIPPETS = [
    pytest.param(page, line, code, id=f"{page.name}:{line}", marks=pytest.mark.slow if snippet_is_slow(code) else ())
    for page in pages()
    for line, code in runnable_snippets(page)
]


@pytest.mark.parametrize("page,line,code", SNIPPETS)
def test_runnable_snippets_run(page, line, code, tmp_path, monkeypatch):
    """Each snippet runs as written, twice in one folder (a user re-running their script)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    script = tmp_path / f"{page.stem}_{line}.py"
    script.write_text(code)
    for _ in range(2):
        _fresh_accelerate_state()
        runpy.run_path(str(script), run_name="__main__")


def _fresh_accelerate_state() -> None:
    """accelerate keeps one process-wide state; a new interpreter starts without it."""

    if "accelerate.state" in sys.modules:
        sys.modules["accelerate.state"].AcceleratorState._reset_state(reset_partial_state=True)


def test_a_snippet_that_fails_fails(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("<!-- runnable -->\n```python\nfrom clipamp_engine import no_such_name\n```\n")
    ((_, code),) = runnable_snippets(page)
    with pytest.raises(ImportError):
        exec(compile(code, str(page), "exec"), {})


def test_pages_are_found_from_the_checkout():
    assert (ROOT / "README.md") in pages() and os.path.isdir(ROOT / "docs")
