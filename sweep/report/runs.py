"""The runs of an experiment as a table to pick a threshold from: read with ``mlflow.search_runs``
(a pandas DataFrame), shown in ≤ 100 columns (``wide``: every summary column), or as markdown.

Shared by ``python -m sweep.report`` and the experiment's description in the MLflow UI.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

import pandas as pd

from sweep.commands import python_command
from sweep.errors import UserError
from sweep.report.format import fmt, pct
from sweep.report.unfinished import MARK, OPEN, PARTIAL, WINDOW_OPEN

#: (column title, DataFrame column of ``mlflow.search_runs``, how a cell is shown), narrow table.
NARROW = [
    ("run", "tags.mlflow.runName", str),
    ("clip", "tags.clip", str),
    ("dtype", "tags.dtype", str),
    ("τ used", "tags.tau_used", str),
    ("τ rec.", "metrics.recommended_max_norm", fmt),
    ("p95", "metrics.grad_norm_p95", fmt),
    ("clipped", "metrics.clip_ratio", pct),
    ("skipped", "metrics.skip_ratio", pct),
    ("loss", "metrics.final_loss", fmt),
    ("eval", "metrics.eval_loss", fmt),
]
#: Added by ``wide`` (after the run name: id and kind, the ``+experiment`` it ran; at the end: the rest).
WIDE_FIRST = [("run_id", "run_id", str), ("kind", "tags.run", str)]  # +experiment=KIND
WIDE_LAST = [
    ("model", "tags.model", str),
    ("data", "tags.data", str),
    ("p50", "metrics.grad_norm_p50", fmt),
    ("p90", "metrics.grad_norm_p90", fmt),
    ("p99", "metrics.grad_norm_p99", fmt),
    ("status", "status", str),
    ("started", "start_time", lambda v: str(v)[:19]),
]
WIDTH = 100
WINDOW_TITLES = {"τ rec.", "p50", "p90", "p95", "p99"}  # OPEN while an unfinished run's first window is open
NUMERIC = {"τ rec.", "p95", "clipped", "skipped", "loss", "eval", "p50", "p90", "p99"}  # right-aligned


@contextmanager
def tracking_uri(uri: str) -> Iterator[None]:
    """``uri`` as MLflow's global tracking URI (``mlflow.search_runs`` reads only that) for the block.

    ``mlflow.set_tracking_uri`` also exports ``$MLFLOW_TRACKING_URI`` to every later child process
    and in-process run; both are put back afterwards.
    """
    import mlflow

    previous = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)  # None: unset again


def search(uri: str, experiment: str, last: int | None = None) -> pd.DataFrame:
    """The runs of the experiment named ``experiment`` (see ``frame``)."""
    import mlflow

    exp = mlflow.MlflowClient(uri).get_experiment_by_name(experiment)
    if exp is None:
        raise UserError(
            f"experiment {experiment!r} not found in the tracking store; run "
            f"`{python_command('sweep')} +experiment=calibrate` first or pass --experiment NAME"
        )
    return frame(uri, exp.experiment_id, last)


def frame(uri: str, experiment_id: str, last: int | None = None) -> pd.DataFrame:
    """The runs of experiment ``experiment_id`` in store ``uri``, newest first (``last``: only the newest
    ``last``), as ``mlflow.search_runs`` gives them (columns ``run_id``, ``status``, ``metrics.*``, ``tags.*``, …)."""
    import mlflow

    with tracking_uri(uri):
        return mlflow.search_runs([experiment_id], order_by=["attributes.start_time DESC"], max_results=last or 100_000)


def _cell(value, show) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return show(value)


def table(runs: pd.DataFrame, wide: bool = False) -> pd.DataFrame:
    """The runs as text cells, one column per title (``wide``: with ids, experiment, model, data, p50/p90/p99,
    status, start); ratios in percent, numbers to 4 significant digits, a missing value as —."""
    spec = NARROW[:1] + WIDE_FIRST + NARROW[1:] + WIDE_LAST if wide else NARROW
    cols = {
        title: [_cell(v, show) for v in (runs[key] if key in runs else [None] * len(runs))] for title, key, show in spec
    }
    cells = pd.DataFrame(cols, columns=[title for title, _, _ in spec])
    if PARTIAL in runs:  # an unfinished run's figures come from its steps.csv (``sweep.report.unfinished``)
        partial, still_open = runs[PARTIAL].to_numpy(bool), runs[WINDOW_OPEN].to_numpy(bool)
        cells.loc[partial, "run"] = cells.loc[partial, "run"] + MARK
        for title in WINDOW_TITLES.intersection(cells.columns):
            cells.loc[still_open & (cells[title] == "—").to_numpy(), title] = OPEN
    return cells


def values(runs: pd.DataFrame) -> pd.DataFrame:
    """The wide table's columns with the store's own values (numbers unrounded, ratios as fractions): for CSV."""
    spec = NARROW[:1] + WIDE_FIRST + NARROW[1:] + WIDE_LAST
    return pd.DataFrame({title: runs[key] if key in runs else None for title, key, _ in spec})


#: Columns shortened with … when a table is wider than its width, in this order, each down to at most
#: this many characters: τ used (a long τ history) first, the run name (what identifies a run) last.
SHORTENED = (("τ used", 12), ("run", 18))


def _cut(v: str, keep: int) -> str:
    """``v`` in ``keep`` characters, ending in … (before an unfinished run's ``MARK``, which stays)."""
    mark = MARK if v.endswith(MARK) else ""
    return v[: keep - 1 - len(mark)] + "…" + mark


def text(cells: pd.DataFrame, width: int | None = WIDTH) -> str:
    """``cells`` as aligned text lines of at most ``width`` characters where ``SHORTENED`` can make them fit
    (``None``: no limit); a table that cannot fit runs wider, every run name still readable."""
    if cells.empty:
        return "no runs yet"
    cells = cells.copy()
    widths = {c: max(len(c), *(len(v) for v in cells[c])) for c in cells.columns}
    for column, floor in SHORTENED:
        over = sum(widths.values()) + 2 * (len(widths) - 1) - (width or 10**9)
        if over > 0 and column in widths and widths[column] > floor:
            keep = max(floor, widths[column] - over)
            cells[column] = [v if len(v) <= keep else _cut(v, keep) for v in cells[column]]
            widths[column] = keep

    def line(values) -> str:
        return "  ".join(
            v.rjust(widths[c]) if c in NUMERIC else v.ljust(widths[c]) for c, v in zip(cells.columns, values)
        ).rstrip()

    return "\n".join([line(cells.columns)] + [line(row) for row in cells.itertuples(index=False)])
