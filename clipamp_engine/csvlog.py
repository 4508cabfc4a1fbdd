"""The canonical per-step CSV: one row per optimizer step, flushed as it is written.

A process killed at any moment (Ctrl-C, SIGTERM, SIGKILL) keeps every completed row: each row
is handed to the OS before ``write`` returns. Reopening an existing file drops a torn last line,
keeps the file's own header, and refuses to repeat a step already written. A row with columns the
header lacks (a clip mode's or forensics' extras, e.g. ``update_l2_pre_clip``) widens the header:
the file is rewritten once, atomically, with the earlier rows' new fields empty.
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
            existing file, whose header wins); columns first seen in a row are appended after them.
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
        """Read the header and last step; cut a torn tail and rows past ``truncate_after``.

        Parsed as CSV (a quoted field may hold a newline); a last row cut short by a kill has no
        final newline or too few fields, and is dropped.
        """
        data = self.path.read_bytes()
        if not data.strip():
            return None
        rows = list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))
        header = rows[0]
        if tuple(header[: len(CANONICAL_COLUMNS)]) != CANONICAL_COLUMNS:
            raise ValueError(f"{self.path} is not a clipamp steps CSV (header {header[:8]}); pass a new path")
        body = [row for row in rows[1:] if row]  # blank lines carry no step
        if body and (not data.endswith(b"\n") or len(body[-1]) != len(header)):
            body.pop()  # the last row was torn by a kill (no newline yet, or cut inside a quoted field)
        kept = []
        for n, row in enumerate(body, 1):
            if len(row) != len(header):
                raise ValueError(
                    f"{self.path}: data row {n} has {len(row)} fields, the header {len(header)}; fix or remove that row"
                )
            step = int(row[0])
            if truncate_after is not None and step > truncate_after:
                break
            kept.append(row)
            self.last_step = step
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([header, *kept])
        if buf.getvalue().encode("utf-8") != data:
            self.path.write_text(buf.getvalue(), encoding="utf-8", newline="")
        return header

    def _write_line(self, fields: Sequence[str]) -> None:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(fields)
        self._file.write(buf.getvalue())
        self._file.flush()

    def write(self, record: StepLog | Mapping[str, Any]) -> None:
        """Append one row (a ``StepLog``/``SkipLog`` or a mapping) and flush it."""
        row = record.row() if isinstance(record, StepLog) else dict(record)
        unknown = [c for c in row if c not in self.columns]
        if unknown:
            self._widen(unknown)
        step = int(row["step"])
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"step {step} is already in {self.path} (last step {self.last_step})")
        self._write_line([_format(row.get(c)) for c in self.columns])
        self.last_step = step

    def _widen(self, columns: list[str]) -> None:
        """Append ``columns`` to the header: rewrite the file (a temporary file, then an atomic rename)."""
        self._file.close()
        with open(self.path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))
        self.columns = self.columns + columns
        tmp = self.path.with_name(self.path.name + ".widen")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f, lineterminator="\n")
            out.writerow(self.columns)
            out.writerows(r + [""] * len(columns) for r in rows[1:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> StepCSVWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
