"""The schema's keys: a key it lacks is refused in one line naming the keys it has.

Hydra refuses ``clip.maxnorm=1`` with "To append to your config use +clip.maxnorm=1", and with the
``+`` the key was added and then ignored: the run went on without it. Here a misspelled key, with or
without ``+``, is a ``UserError`` naming the closest key and the keys of its section. Keys under a
free-form ``dict`` field (a custom model's ``model.kwargs``, ``model.config``) are the user's own.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterator
from typing import Any

from sweep.config.schema import Config
from sweep.errors import UserError


def given(overrides: list[str]) -> Iterator[tuple[str, str, str]]:
    """Each command-line override as it was given without Hydra's ``+``/``~`` prefix, its key, its value."""
    for arg in overrides:
        text = arg.lstrip("+~")
        key, _, value = text.partition("=")
        yield text, key, value


def _fields(cls: type) -> dict[str, Any]:
    """A schema dataclass's field names → their resolved types."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def unknown_key(dotted: str, root: type = Config) -> UserError | None:
    """The error for ``dotted`` (``clip.maxnorm``) when the schema has no such key, else ``None``."""
    cls, parts = root, dotted.split(".")
    for i, name in enumerate(parts):
        fields = _fields(cls)
        if name not in fields:
            section = ".".join(parts[:i])
            key = f"{section}.{name}" if section else name
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"did you mean {f'{section}.{close[0]}' if section else close[0]}? " if close else ""
            where = f"of {section}" if section else "of the config"
            return UserError(f"{key} is not a key {where}: {hint}its keys are {', '.join(sorted(fields))}")
        if not dataclasses.is_dataclass(fields[name]):
            return None  # a value, or a free-form dict: whatever lies below it is the user's
        cls = fields[name]
    return None


def refuse_unknown_keys(tree: dict[str, Any], root: type = Config, prefix: str = "") -> None:
    """``UserError`` for the first key of ``tree`` (a composed config as plain dicts) the schema lacks."""
    fields = _fields(root)
    for name, value in tree.items():
        error = unknown_key(f"{prefix}{name}", Config) if name not in fields else None
        if error is not None:
            raise error
        if isinstance(value, dict) and dataclasses.is_dataclass(fields[name]):
            refuse_unknown_keys(value, fields[name], f"{prefix}{name}.")
