"""A resumed run's ``steps.csv``: checked on a copy before the file itself is touched.

A resume is decided (checkpoint read, engine restored, rows 1..the checkpoint's step present)
before the CSV is cut back to the checkpoint, so a refused resume leaves the file byte for byte.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

from clipamp_engine import StepCSVWriter
from sweep.errors import UserError, one_line
from sweep.run.summary import read_rows


def open_steps_csv(
    path: Path, columns: tuple[str, ...], truncate_after: int | None, shown: Path | None = None
) -> StepCSVWriter:
    """The run's CSV writer (rows past ``truncate_after`` dropped); one line naming ``shown`` (default
    ``path``) if the file is no steps CSV."""
    try:
        return StepCSVWriter(path, columns, truncate_after=truncate_after)
    except (ValueError, IndexError, UnicodeDecodeError) as e:
        raise UserError(
            f"{shown or path} is not a readable steps CSV ({one_line(e).replace(str(path), str(shown or path))}); "
            f"move it away and start a new run (drop resume=)"
        ) from None


def resumed_rows(run_id: str, csv_path: Path, columns: tuple[str, ...], step: int) -> list[dict[str, Any]]:
    """Rows 1..``step`` of a resumed run's CSV, read from a copy cut as the resume will cut the file
    (``StepCSVWriter(truncate_after=step)``); ``UserError`` if the file is missing or lacks any of them."""
    if not csv_path.exists():
        raise UserError(
            f"resume={run_id}: {csv_path} is missing, so it does not hold steps 1–{step} of the checkpoint: "
            f"resuming would lose them and the summary built from them; restore steps.csv or start a new "
            f"run (drop resume=)"
        )
    trial = csv_path.with_name(csv_path.name + ".resume")
    try:
        shutil.copyfile(csv_path, trial)
        open_steps_csv(trial, columns, step, shown=csv_path).close()
        rows = read_rows(trial)
    except UserError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"resume={run_id}: {csv_path} has an unreadable row ({one_line(e)}); "
            f"restore the file or start a new run (drop resume=)"
        ) from None
    finally:
        trial.unlink(missing_ok=True)
    if [r["step"] for r in rows] != list(range(1, step + 1)):
        raise UserError(
            f"resume={run_id}: {csv_path} does not hold steps 1–{step} of the checkpoint "
            f"({len(rows)} rows): resuming would lose rows and the summary built "
            f"from them; restore steps.csv or start a new run (drop resume=)"
        )
    return rows


class NoCSV(contextlib.nullcontext):
    """The CSV of a rank other than 0: it writes none."""

    def write(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
