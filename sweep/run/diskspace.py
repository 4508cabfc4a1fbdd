"""A full disk: recognise it whatever reports it, and keep room to close the run.

A full disk surfaces as ``OSError`` ENOSPC/EDQUOT/EFBIG (the CSV), sqlite's "database or disk is
full" inside an ``MlflowException`` (metrics, status) or a ``RuntimeError`` from ``torch.save``
(the checkpoint; ``checkpoint._write`` turns that one into ENOSPC). A run keeps a small reserve
file beside its checkpoint (the "ballast file" technique): released when the disk fills, it gives
sqlite room to record the buffered metrics and end the run KILLED, so that it can be resumed.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

RESERVE_BYTES = 1 << 20  # a status update and ≤ flush_every steps of metrics need far less
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(exc: BaseException) -> str | None:
    """What could not be written, if ``exc`` (or an exception it came from) is a full disk; else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL:
            return str(exc.filename) if exc.filename else "a file"
        if "database or disk is full" in str(exc):
            return "the tracking store"
        exc = exc.__cause__ or exc.__context__
    return None


class SpaceReserve:
    """``RESERVE_BYTES`` held in ``path`` until ``release``; silently absent if it cannot be written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(b"\0" * RESERVE_BYTES)  # written, not sparse: the blocks are really taken
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            path.unlink(missing_ok=True)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
