"""``engine_check``: an engine object built from a config group's options, its ``ValueError`` turned into a
one-line ``UserError`` named by config key with the fix (``validate`` checks the ranges the engine checks
itself this way, without restating them)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from sweep.errors import UserError

#: What a null ``calibrate.*`` value means, added to the engine's message about that key.
_NULL_MEANS = {
    "calibrate.quantile": "aim τ at calibrate.target_clip",
    "calibrate.cap": "no clipping during the window",
}


def engine_check(
    build: Callable[[], object], group: str, node: Any, options: dict[str, Any], defaults: dict[str, Any] | None = None
) -> None:
    """Build an engine object from ``group``'s ``options`` (``node``: the config group): its ``ValueError``
    becomes a one-line ``UserError`` whose option names are config keys (``window=1`` →
    ``calibrate.window=1``), ending with the fix: the first key it names that differs from its
    default (``defaults``, else the schema's), at that default."""
    try:
        build()
    except ValueError as e:
        names = "|".join(sorted(options, key=len, reverse=True))
        line = " ".join(str(e).split())
        line = re.sub(rf"(?<![\w.])({names})(?= ?(?:=|<=|>=|<|>))", rf"{group}.\1", line)
        line = re.sub(rf"(?<=<= )({names})\b", rf"{group}.\1", line)
        line = re.sub(r"\bclip mode '(\w+)'", r"clip=\1", line)  # the engine's name for what the app spells so
        named = re.findall(rf"{group}\.({names})\b", line)
        defaults = defaults if defaults is not None else dataclasses.asdict(type(node)())
        changed = [k for k in named if getattr(node, k) != defaults.get(k)] or named
        if changed:
            key, default = f"{group}.{changed[0]}", defaults.get(changed[0])
            fix, meaning = f"{key}={_shown(default)}", _NULL_MEANS.get(key)
            if meaning:
                fix += f" ({meaning})" if default is None else f", or null ({meaning})"
            line += f": pass e.g. {fix}"
        raise UserError(line) from None


def _shown(value: Any) -> str:
    """A value as an override would spell it (``[0.01,0.05]``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(_shown, value)) + "]"
    return str(value)
