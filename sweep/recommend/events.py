"""TensorBoard event files: whether one is whole, and whether several runs are the pieces of one resumed run.

``EventAccumulator`` stops silently at a torn record. An event file is a TFRecord stream: each record is an
8-byte little-endian length, the masked CRC-32C of those 8 bytes, the data, and the data's masked CRC. A
file cut short (a disk filled, a copy interrupted, a run still writing) ends inside a record; a file that
is not an event file at all fails the first length CRC. ``tensorboard``'s reader logs either at debug level
and returns the events before it, so a torn file reads as a shorter log, and one torn before its first
whole record as holding nothing. ``framing_problem`` walks the framing (the length CRCs, not the data) to
say which.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

_HEADER, _FOOTER = 12, 4


def framing_problem(path: Path) -> tuple[int, str | None]:
    """The whole records at the start of ``path`` and what is wrong after them (``None``: the file ends on
    a record boundary)."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    size, offset, records = path.stat().st_size, 0, 0
    with open(path, "rb") as f:
        while offset < size:
            header = f.read(_HEADER)
            if len(header) < _HEADER:
                return records, f"ends mid-record at byte {size} (a record header starts at byte {offset})"
            (length,) = struct.unpack("<Q", header[:8])
            if struct.unpack("<I", header[8:])[0] != masked_crc32c(header[:8]):
                if not records:
                    return records, "has no TensorBoard record framing at its start (not an event file)"
                return records, f"has a corrupt record header at byte {offset}"
            end = offset + _HEADER + length + _FOOTER
            if end > size:
                return records, f"ends mid-record at byte {size} (a {length}-byte record starts at byte {offset})"
            offset = end
            f.seek(offset)
            records += 1
    return records, None


def every(steps: np.ndarray) -> int:
    """The most common gap between a piece's logged steps (1 for a single step)."""
    gaps = np.diff(steps)
    gaps = gaps[gaps > 0]
    return int(np.bincount(gaps).argmax()) if len(gaps) else 1


def span(piece: dict) -> str:
    steps, n = piece["steps"], every(piece["steps"])
    return f"steps {steps.min()}–{steps.max()}" + (f", every {n}" if n > 1 else "")


def event_files(run: Path) -> str:
    return ", ".join(sorted(f.name for f in run.glob("*tfevents*"))) if run.is_dir() else run.name


def not_resumed(pieces: list[dict], name: str) -> str:
    """Why the runs are not pieces of one resumed run ('' when they are): ordered by their first event's wall
    time, each later one must start after the previous one's first step and at most one step after its last
    (HF resumed from a checkpoint), and not start over: a piece whose first step is its own logging grid's first
    (step N of every N), or no later than the first piece's, is a separate run (HF run again into the same
    output_dir, with another logging_steps), however much its steps overlap the earlier's."""
    ordered = sorted(pieces, key=lambda p: p["wall"])
    if any(p["name"] != name or not len(p["steps"]) for p in ordered):
        return " (under different names)"
    first = ordered[0]["steps"].min()
    for prev, p in zip(ordered, ordered[1:], strict=False):
        start = int(p["steps"].min())
        if start <= max(every(p["steps"]), first) or start <= prev["steps"].min():
            return (
                f" and {p['run'].name} ({span(p)}) starts over rather than where {prev['run'].name} "
                f"({span(prev)}) left off: separate runs, not the pieces of one resumed run"
            )
        if start > prev["steps"].max() + 1:
            return f" and {p['run'].name} starts at step {start}, after a gap past {prev['run'].name}'s last step"
    return ""
