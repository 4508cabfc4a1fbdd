"""The canonical per-step CSV: one row per optimizer step, flushed as it is written.

A process killed at any moment (Ctrl-C, SIGTERM, SIGKILL) keeps every completed row: each row
is handed to the OS before ``write`` returns. By default an earlier steps CSV at the path is
replaced (a re-run works); ``mode="resume"`` continues it instead: the file's own header is kept,
a torn last line dropped, and a step already written is refused before anything in the file changes.
A row with columns the header lacks (a clip mode's or forensics' extras, e.g. ``update_l2_pre_clip``) widens the header:
the file is rewritten once, atomically, with the earlier rows' new fields empty.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .records import CANONICAL_COLUMNS, StepLog

DEFAULT_EXTRA_COLUMNS = ("clipped", "token_count", "max_norm")


def _format(value: Any) -> str:
    """A field: a number as Python writes it (shortest round-trip repr), numpy scalars and one-element tensors
    included (their own repr, ``np.float64(0.1)`` or ``tensor(0.2500)``, is no number, and rounds)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    elif type(value).__module__ == "numpy" and getattr(value, "size", 0) == 1:  # (numpy is not imported here)
        value = value.item()
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(float(value))
    return str(value)


MODES = ("overwrite", "resume", "new")


class StepCSVWriter:
    """Append-only writer of per-step rows with the canonical columns first.

    What happens to an existing file at ``path`` is the ``mode``:

    - ``"overwrite"`` (the default, so that re-running a script works): an earlier steps CSV there
      is replaced; any other file is refused, untouched.
    - ``"resume"``: continue the file — its header wins, a torn last line is dropped, and a step
      not after its last step is refused (``ValueError``). Nothing in the file changes before the
      first accepted row (or a ``close`` with nothing refused), so a refused write leaves it
      byte-identical.
    - ``"new"``: refuse any existing non-empty file, untouched.

    Args:
        path: the CSV file; parent folders are created.
        extra_columns: columns after the canonical eight (ignored when resuming, where the file's
            header wins); columns first seen in a row are appended after them.
        mode: ``"overwrite"``, ``"resume"`` or ``"new"``; default ``"resume"`` when
            ``truncate_after`` is given, else ``"overwrite"``.
        truncate_after: resume from a checkpoint taken at this step: rows whose step is greater
            are dropped at once (the next row is the step after it); ``None`` keeps every complete row.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        extra_columns: Sequence[str] = DEFAULT_EXTRA_COLUMNS,
        *,
        mode: str | None = None,
        truncate_after: int | None = None,
    ) -> None:
        mode = mode if mode is not None else ("resume" if truncate_after is not None else "overwrite")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {', '.join(MODES)}")
        if truncate_after is not None and mode != "resume":
            raise ValueError(f"truncate_after={truncate_after!r} resumes a file: it needs mode='resume' (got {mode!r})")
        self.path, self.mode = Path(path), mode
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.last_step: int | None = None
        self._file = None
        self._rewrite: str | None = None  # resume: the file without its torn tail, written on the first row
        self._refused = False
        self._closed = False
        existing = self._existing_header() if self.path.exists() else None
        if existing and mode == "new":
            raise ValueError(f"{self.path} already exists: pass mode='overwrite' to replace it or mode='resume'")
        if existing and mode == "resume":
            self.columns = self._recover(existing, truncate_after)
            if truncate_after is not None:  # the caller resumes at truncate_after + 1: nothing can be refused
                self._apply_rewrite()
        else:
            self.columns = list(CANONICAL_COLUMNS) + list(
                dict.fromkeys(c for c in extra_columns if c not in CANONICAL_COLUMNS)
            )
            self._file = open(self.path, "w", newline="", encoding="utf-8")
            self._write_line(self.columns)

    def _existing_header(self) -> list[str] | None:
        """The header of a non-empty steps CSV at ``path``; ``None`` for an empty file; else ``ValueError``."""
        with open(self.path, "rb") as f:
            head = f.read(1 << 16)
        if not head.strip():
            return None
        header = next(csv.reader([head.split(b"\n", 1)[0].decode("utf-8", errors="replace")]), [])
        if tuple(header[: len(CANONICAL_COLUMNS)]) != CANONICAL_COLUMNS:
            raise ValueError(f"{self.path} is not a clipamp steps CSV (header {header[:8]}); pass a new path")
        return header

    def _recover(self, header: list[str], truncate_after: int | None) -> list[str]:
        """Find the last step; prepare the file without a torn tail and rows past ``truncate_after``.

        Parsed as CSV (a quoted field may hold a newline); a last row cut short by a kill has no
        final newline or too few fields, and is dropped.
        """
        data = self.path.read_bytes()
        rows = list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))
        header = rows[0]
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
            self._rewrite = buf.getvalue()
        return header

    def _apply_rewrite(self) -> None:
        """Resume: write the recovered file (atomically) if it differs, and open it for appending."""
        if self._rewrite is not None:
            tmp = self.path.with_name(self.path.name + ".resume")
            tmp.write_text(self._rewrite, encoding="utf-8", newline="")
            os.replace(tmp, self.path)
            self._rewrite = None
        if self._file is None:
            self._file = open(self.path, "a", newline="", encoding="utf-8")

    def _write_line(self, fields: Sequence[str]) -> None:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(fields)
        self._file.write(buf.getvalue())
        self._file.flush()

    def write(self, record: StepLog | Mapping[str, Any]) -> None:
        """Append one row (a ``StepLog``/``SkipLog`` or a mapping) and flush it.

        A step not after the last one written is refused (``ValueError``) before the file changes.
        """
        if self._closed:
            raise ValueError(
                f"{self.path} is closed: write inside the `with StepCSVWriter(...)` block, or reopen it with "
                "StepCSVWriter(path, mode='resume') to add rows"
            )
        if not isinstance(record, (StepLog, Mapping)):
            raise ValueError(
                f"write takes a StepLog/SkipLog or a mapping of columns, not a {type(record).__name__} (the file is "
                "unchanged)"
            )
        row = record.row() if isinstance(record, StepLog) else dict(record)
        if row.get("step") is None:
            raise ValueError(
                f"a row without a step: got columns {', '.join(map(str, row)) or 'none'}; write a StepLog/SkipLog "
                f"or a mapping with 'step' (the file is unchanged)"
            )
        try:
            step = int(row["step"])
        except (TypeError, ValueError):
            raise ValueError(f"step={row['step']!r} is not a step number (the file is unchanged)") from None
        if self.last_step is not None and step <= self.last_step:
            self._refused = True
            raise ValueError(
                f"step {step} is already in {self.path} (last step {self.last_step}): the file is unchanged; "
                f"resuming from a checkpoint at step {step - 1}, pass truncate_after={step - 1} to drop the rows "
                "after it (mode='overwrite' replaces the whole file)"
            )
        self._apply_rewrite()
        unknown = [c for c in row if c not in self.columns]
        if unknown:
            self._widen(unknown)
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
        """Close the file; a resumed file nothing was refused from loses its torn tail here."""
        if self._file is None and self._rewrite is not None and not self._refused:
            self._apply_rewrite()
        if self._file is not None:
            self._file.close()
        self._closed = True

    def __enter__(self) -> StepCSVWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
