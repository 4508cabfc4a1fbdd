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

from sweep.errors import UserError

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


def full_disk_error(exc: BaseException, reserve: SpaceReserve, resumable: bool) -> UserError:
    """Release the reserve (room for the store to record the run's end) and say what to do, in one line."""
    reserve.release()
    fix = (
        "resume with resume=true (it continues from the last checkpoint)"
        if resumable
        else "start the run again (no checkpoint was written yet)"
    )
    return UserError(f"no space left on the device while writing {disk_full(exc)}; free space there and {fix}")


class SpaceReserve:
    """``RESERVE_BYTES`` held in ``path`` until ``release``; silently absent if it cannot be written
    (or if ``path`` is None: a rank that writes nothing)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(b"\0" * RESERVE_BYTES)  # written, not sparse: the blocks are really taken
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            path.unlink(missing_ok=True)

    def release(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
