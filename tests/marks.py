"""Which test modules a ``-m`` expression leaves nothing to run in, read from their source.

``pytest -m "not slow"`` still imports every module to deselect its tests, and a module whose tests are
all slow (``pytestmark = pytest.mark.slow``) often imports the heaviest packages (transformers' Trainer,
datasets). ``tests/conftest.py`` skips such a module at collection when the expression can select none of
its tests whatever other marks they carry, so the deselected count leaves those tests out.
"""

from __future__ import annotations

import ast
from pathlib import Path


def _mark_name(node: ast.expr) -> str | None:
    """``slow`` for ``pytest.mark.slow`` or ``pytest.mark.slow(...)``; None for anything else."""
    if isinstance(node, ast.Call):
        node = node.func
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "pytest"
    ):
        return node.attr
    return None


def module_marks(path: Path) -> frozenset[str]:
    """The marks every test of the module at ``path`` carries by its one module-level ``pytestmark``
    assignment (``pytest.mark.NAME``, or a list or tuple holding some); empty when it has none, assigns it
    more than once, or the file does not parse."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if "pytestmark" not in text:
        return frozenset()
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError:
        return frozenset()
    values = [
        node.value
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
        and any(
            isinstance(t, ast.Name) and t.id == "pytestmark"
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
    ]
    if len(values) != 1 or values[0] is None:
        return frozenset()
    (value,) = values
    items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    return frozenset(name for item in items if (name := _mark_name(item)))


def can_select(markexpr: str, marks: frozenset[str]) -> bool:
    """Whether ``-m markexpr`` can select a test that carries ``marks`` and any other marks: False only when
    every choice of the other marks (and of the arguments of any mark the expression names with some) fails.
    It reads the expression with pytest's own parser, a private module: should that change, every module is
    selectable (collected as without this hook)."""
    try:
        from _pytest.mark.expression import Expression

        expression = Expression.compile(markexpr)
    except Exception:  # pytest's private parser moved or changed: collect everything, as pytest would
        return True

    def search(chosen: dict) -> bool:
        unchosen = []

        def matcher(name: str, /, **kwargs) -> bool:
            if name in marks and not kwargs:
                return True
            key = (name, tuple(sorted(kwargs.items())))
            if key not in chosen:
                unchosen.append(key)
            return chosen.get(key, False)

        if expression.evaluate(matcher):
            return True
        return bool(unchosen) and (search({**chosen, unchosen[0]: True}) or search({**chosen, unchosen[0]: False}))

    try:
        return search({})
    except Exception:  # a matcher protocol pytest has changed: collect everything
        return True
