"""The app's shape: its import graph has no cycle, between modules or between packages, and points
down the layers; modules and functions stay small; importing it leaves global state (warning filters) alone."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.helpers import REPO

SWEEP = REPO / "sweep"
#: The experiments' entry points: they (and the app) call the reports; nothing below them does.
ENTRY_POINTS = {
    "sweep.app",
    "sweep.__main__",
    "sweep.experiments.training",
    "sweep.experiments.study.sweep",
    "sweep.experiments.spike.experiment",
}
#: Layers that never import presentation or experiments.
LOWER = (
    "sweep.errors",
    "sweep.config",
    "sweep.tasks",
    "sweep.run",
    "sweep.tracking",
    "sweep.distributed",
    "sweep.results",
    "sweep.pick",
)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = SWEEP) -> dict[str, set[str]]:
    """Module → the ``sweep`` modules it imports anywhere in its body (function-level and
    ``TYPE_CHECKING`` imports included; ``from pkg import name`` counts ``pkg``, and ``pkg.name`` when that
    is a module)."""
    modules = {module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from pkg import mod`` runs pkg/__init__ first: it imports the package and the module
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


@functools.cache
def _app_graph() -> dict[str, frozenset[str]]:
    return {m: frozenset(ts) for m, ts in import_graph().items()}


def app_graph() -> dict[str, set[str]]:
    """``import_graph()`` of ``sweep/``, parsed once per process (its files do not change during a test run);
    a copy of its own for each caller."""
    return {m: set(ts) for m, ts in _app_graph().items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first = last), or None (iterative DFS, three colours)."""
    colour = {n: 0 for n in graph}
    for start in graph:
        if colour[start]:
            continue
        stack, path = [(start, iter(sorted(graph[start])))], [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(child) == 1:
                return path[path.index(child) :] + [child]
            elif colour.get(child) == 0:
                colour[child] = 1
                stack.append((child, iter(sorted(graph.get(child, ())))))
                path.append(child)
    return None


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"b2"}, "b2": {"b"}}) == ["b", "b2", "b"]


def test_import_graph_resolves_relative_and_lazy_imports(tmp_path):
    pkg = tmp_path / "sweep"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sweep.sub.b\n")
    (pkg / "sub" / "d.py").write_text("from . import b\n")
    import tests.app.test_architecture as me

    old = me.REPO
    me.REPO = tmp_path
    try:
        graph = import_graph(pkg)
    finally:
        me.REPO = old
    assert graph["sweep.sub"] == {"sweep.sub.b"} and graph["sweep.sub.b"] == {"sweep.c"}
    assert graph["sweep.sub.d"] == {"sweep.sub", "sweep.sub.b"}  # ``from pkg import mod`` runs pkg first
    assert find_cycle(graph) == ["sweep.c", "sweep.sub.b", "sweep.c"]


def test_app_import_graph_is_acyclic():
    graph = app_graph()
    assert len(graph) > 30 and "sweep.run.pipeline" in graph["sweep.experiments.training"]
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph))


def package_graph(
    graph: dict[str, set[str]], depth: int | None = None, packages: set[str] | None = None
) -> dict[str, set[str]]:
    """``graph`` with each module replaced by its package: the folder it is in (``depth=None``), or the
    package ``depth`` names deep (``depth=2``: ``sweep.run``, ``sweep.experiments``). Modules at the top of
    ``sweep/`` (``sweep.app``, ``sweep.errors``) stay nodes of their own; edges inside a package drop out.
    ``packages``: the names that are packages (default: those with an ``__init__.py`` under ``sweep/``)."""
    if packages is None:
        packages = {module_name(p) for p in SWEEP.rglob("__init__.py")}

    def unit(m: str) -> str:
        own = m if m in packages else m.rpartition(".")[0]
        own = own if depth is None else ".".join(own.split(".")[:depth])
        return m if own == "sweep" else own

    out: dict[str, set[str]] = {}
    for m, ts in graph.items():
        out.setdefault(unit(m), set()).update(unit(t) for t in ts)
    return {u: ts - {u} for u, ts in out.items()}


def test_package_graph_finds_cycles_no_module_cycle_shows():
    # a.x → b.y → a.z: no module cycle, but packages a and b import each other; a.c.w → b.y only
    graph = {"sweep.a.x": {"sweep.b.y"}, "sweep.b.y": {"sweep.a.z", "sweep.errors"}, "sweep.a.z": set()}
    graph |= {"sweep.a.c.w": {"sweep.b.y"}, "sweep.errors": set(), "sweep.app": {"sweep.a.x"}}
    packages = {"sweep", "sweep.a", "sweep.b", "sweep.a.c"}
    assert find_cycle(graph) is None
    folders = package_graph(graph, packages=packages)
    assert folders == {
        "sweep.a": {"sweep.b"},
        "sweep.b": {"sweep.a", "sweep.errors"},
        "sweep.a.c": {"sweep.b"},
        "sweep.errors": set(),
        "sweep.app": {"sweep.a"},
    }
    assert find_cycle(folders) == ["sweep.a", "sweep.b", "sweep.a"]
    top = package_graph(graph, depth=2, packages=packages)
    assert set(top) == {"sweep.a", "sweep.b", "sweep.errors", "sweep.app"} and top["sweep.a"] == {"sweep.b"}


@pytest.mark.parametrize("depth", [None, 2], ids=["folders", "top-level"])
def test_app_package_graph_is_acyclic(depth):
    """No package imports a package that imports it back (``sweep.run`` → ``sweep.tracking`` → ``sweep.run``),
    neither between folders (``sweep.experiments.study`` ↔ ``sweep.experiments.spike``) nor between
    the top-level packages."""
    graph = package_graph(app_graph(), depth)
    assert {"sweep.run", "sweep.tracking", "sweep.distributed", "sweep.report", "sweep.app"} <= set(graph)
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph))


def test_reports_depend_only_downward():
    """The reports read results (``sweep.results``) and tracking; no experiment, no entry point."""
    graph = app_graph()
    up = [(m, t) for m, ts in graph.items() if m.startswith("sweep.report") for t in ts]
    up = [(m, t) for m, t in up if t.startswith(("sweep.experiments", "sweep.app", "sweep.__main__"))]
    assert not up, f"reports import experiments or entry points: {up}"


def test_imports_point_down_the_layers():
    graph = app_graph()
    up = [
        (m, t)
        for m, ts in graph.items()
        for t in ts
        if m.startswith(LOWER) and t.startswith(("sweep.report", "sweep.experiments", "sweep.app"))
    ]
    assert not up, f"lower layers import presentation or experiments: {up}"
    report = [(m, t) for m, ts in graph.items() for t in ts if m.startswith("sweep.report") and t in ENTRY_POINTS]
    assert not report, f"reports import an entry point: {report}"


def _long_functions(path: Path, limit: int = 70) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            if n > limit and "long because" not in doc:
                out.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_modules_and_functions_are_small():
    big = [f"{p.relative_to(REPO)} ({n})" for p in SWEEP.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400]
    assert not big, f"app modules over 400 lines: {big}"
    long = [f for p in SWEEP.rglob("*.py") for f in _long_functions(p)]
    assert not long, f"functions over 70 lines without 'long because' in their docstring: {long}"


@pytest.mark.slow  # a fresh interpreter importing torch, mlflow, optuna, …
def test_importing_the_app_leaves_warning_filters_alone():
    third_party = "torch, numpy, pandas, matplotlib.pyplot, mlflow, optuna, hydra, omegaconf, rich, sqlalchemy"
    code = (
        f"import warnings, {third_party}; before = list(warnings.filters); "
        "import sweep.app, sweep.report.cli, sweep.experiments.study.sweep; "
        "assert warnings.filters == before, set(map(str, warnings.filters)) - set(map(str, before))"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("module", ["sweep.report.cli", "sweep.app"])
def test_graph_names_real_modules(module):
    assert module in app_graph()


#: The design card's top level, and the usual extras beside it.
DESIGN_CARD = {"pyproject.toml", "README.md", "conf", "sweep", "clipamp_engine", "tests", "mlruns"}
EXTRAS = {"docs", "examples", "bench", "scripts", ".ci", ".gitignore", "CONTRIBUTING.md"}


def test_the_top_level_is_the_design_cards():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    top = {line.split("/")[0] for line in tracked.splitlines()}
    assert DESIGN_CARD <= top, f"missing at the top level: {sorted(DESIGN_CARD - top)}"
    assert top <= DESIGN_CARD | EXTRAS, f"unexpected at the top level: {sorted(top - DESIGN_CARD - EXTRAS)}"
    assert not (SWEEP / "conf").exists(), "one config tree: conf/ at the top level, shipped as sweep/conf"


def test_the_checkout_composes_the_top_level_conf():
    from sweep.__main__ import CONF_DIR

    assert CONF_DIR == REPO / "conf" and (CONF_DIR / "config.yaml").is_file()


def test_the_readme_layout_names_every_package():
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Layout\n", 1)[1].split("```", 2)[1]
    named = {line.split()[0].rstrip("/") for line in block.splitlines() if line.startswith("sweep/")}
    packages = {str(p.parent.relative_to(REPO)) for p in SWEEP.glob("*/__init__.py")}
    assert packages <= named, f"packages missing from the README's layout: {sorted(packages - named)}"
