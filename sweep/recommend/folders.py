"""The log in a folder that holds neither a ``Trainer`` state nor TensorBoard events: its CSV.

Lightning's ``CSVLogger`` writes ``<save_dir>/<name>/version_N/metrics.csv`` and prints the folder; a
loop of one's own writes its CSV into its output folder. A folder with one CSV under it is read as that
CSV; one with several is refused with their list, each a path to pass, rather than a guess.
"""

from __future__ import annotations

from pathlib import Path

from sweep.errors import UserError

#: What a folder holds that the command could read, for the message when it holds none of it.
READABLE = "trainer_state.json, checkpoint-N/, TensorBoard event file or CSV"


def csv_in(folder: Path, limit: int = 8) -> Path:
    """The one CSV (or TSV) under ``folder``; a ``UserError`` naming them when there are several or none."""
    found = sorted(f for f in folder.rglob("*") if f.suffix in (".csv", ".tsv") and f.is_file())
    if len(found) == 1:
        return found[0]
    if not found:
        raise UserError(f"{folder}: a folder with no {READABLE}: pass a log, or the folder that holds one")
    listed = " ".join(str(f) for f in found[:limit]) + (f" … ({len(found) - limit} more)" if len(found) > limit else "")
    raise UserError(
        f"{folder}: {len(found)} CSV files under this folder (and no trainer_state.json or "
        f"TensorBoard events): pass one of them: {listed}"
    )
