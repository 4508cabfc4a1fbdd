"""The canonical per-step CSV: one row per optimizer step, flushed as it is written.

A process killed at any moment (Ctrl-C, SIGTERM, SIGKILL) keeps every completed row: each row
is handed to the OS before ``write`` returns. Reopening an existing file drops a torn last line,
keeps the file's own header, and refuses to repeat a step already written.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .records import CANONICAL_COLUMNS, StepLog

DEFAULT_EXTRA_COLUMNS = ("clipped", "token_count", "max_norm")


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value)


class StepCSVWriter:
    """Append-only writer of per-step rows with the canonical columns first.

    Args:
        path: the CSV file; parent folders are created.
        extra_columns: columns after the canonical eight (ignored when appending to an
            existing file, whose header wins).
        truncate_after: when reopening, drop rows whose step is greater than this (resume
            from a checkpoint taken at that step); ``None`` keeps every complete row.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        extra_columns: Sequence[str] = DEFAULT_EXTRA_COLUMNS,
        *,
        truncate_after: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.last_step: int | None = None
        existing = self._recover(truncate_after) if self.path.exists() else None
        if existing:
            self.columns = existing
            self._file = open(self.path, "a", newline="", encoding="utf-8")
        else:
            self.columns = list(CANONICAL_COLUMNS) + [c for c in extra_columns if c not in CANONICAL_COLUMNS]
            self._file = open(self.path, "w", newline="", encoding="utf-8")
            self._write_line(self.columns)

    def _recover(self, truncate_after: int | None) -> list[str] | None:
        """Read the header and last step; cut a torn tail and rows past ``truncate_after``."""
        data = self.path.read_bytes()
        if not data.strip():
            return None
        keep = data[: data.rfind(b"\n") + 1]  # a line without its newline was torn by a kill
        lines = keep.decode("utf-8").splitlines(keepends=True)
        header = next(csv.reader([lines[0]]))
        if tuple(header[: len(CANONICAL_COLUMNS)]) != CANONICAL_COLUMNS:
            raise ValueError(f"{self.path} is not a clipamp steps CSV (header {header[:8]}); pass a new path")
        kept = [lines[0]]
        for line in lines[1:]:
            step = int(line.split(",", 1)[0])
            if truncate_after is not None and step > truncate_after:
                break
            kept.append(line)
            self.last_step = step
        text = "".join(kept)
        if text.encode("utf-8") != data:
            self.path.write_text(text, encoding="utf-8")
        return header

    def _write_line(self, fields: Sequence[str]) -> None:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(fields)
        self._file.write(buf.getvalue())
        self._file.flush()

    def write(self, record: StepLog | Mapping[str, Any]) -> None:
        """Append one row (a ``StepLog``/``SkipLog`` or a mapping) and flush it."""
        row = record.row() if isinstance(record, StepLog) else dict(record)
        unknown = set(row) - set(self.columns)
        if unknown:
            raise ValueError(f"columns {sorted(unknown)} are not in this CSV's header {self.columns}")
        step = int(row["step"])
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"step {step} is already in {self.path} (last step {self.last_step})")
        self._write_line([_format(row.get(c)) for c in self.columns])
        self.last_step = step

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "StepCSVWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
