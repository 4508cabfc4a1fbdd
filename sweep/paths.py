"""Whether the app can write where it was told to, asked before any work depends on it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_refusal(path: Path, *, is_file: bool = False) -> str | None:
    """Why ``path`` (a folder to create, or with ``is_file`` a file to write) cannot be, or ``None``.

    Its nearest existing folder must be a writable folder (not a file, not read-only); an existing
    ``path`` must be a writable file when ``is_file``, a folder otherwise.
    """
    target = path.absolute()
    if target.exists():
        if is_file and (target.is_dir() or not os.access(target, os.W_OK)):
            return f"{target} is {'a folder' if target.is_dir() else 'not writable'}"
        if not is_file and not target.is_dir():
            return f"{target} is a file"
    existing = target.parent if is_file else target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def space_refusal(path: Path, least: int = 256 << 10) -> str | None:
    """Why ``path`` (a folder to create) cannot take ``least`` bytes of small files: its disk is full; or ``None``."""
    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return None
    return f"no space left on the device of {existing} ({free >> 10} KiB free)" if free < least else None
