"""Formatting shared by every report: numbers, percentages, markdown tables, wide terminal tables."""

from __future__ import annotations

import math
import shlex
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console

from sweep.commands import mlflow_command
from sweep.tracking.ui import runs_page


def fmt(v: Any) -> str:
    """Floats to 4 significant digits (NaN as —), anything else as ``str``."""
    if isinstance(v, float):
        return "—" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def pct(x: float | None, signed: bool = False) -> str:
    """A ratio as a percentage with one decimal (``signed``: with its sign); — when missing or not finite."""
    if x is None or not math.isfinite(x):
        return "—"
    return f"{x * 100:+.1f}%" if signed else f"{x:.1%}"


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells through ``fmt``; ends with a newline."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def frame_markdown(df) -> str:
    """A pandas DataFrame as a markdown table."""
    return markdown_table(list(df.columns), df.itertuples(index=False))


def ui_command(uri: str, experiment_id: str | None = None) -> str:
    """How to see the runs in the MLflow UI: a loopback-only ``mlflow ui``, or the server's page; the link
    opens the experiment's training runs with the answer's columns (``sweep.tracking.ui``)."""
    page = runs_page(experiment_id)
    if uri.startswith(("http://", "https://")):
        return f"open {uri.rstrip('/')}/{page}"
    return (
        f"{mlflow_command()} ui --backend-store-uri {shlex.quote(uri)} --host 127.0.0.1 --port 5000  → "
        f"http://127.0.0.1:5000/{page}"
    )


def print_wide(console: Console, renderable: Any, width: int = 110) -> None:
    """Print at ``width`` columns when the output is not a terminal (a pipe or log file does not wrap)."""
    if console.is_terminal or console.width >= width:
        console.print(renderable)
        return
    Console(file=console.file, width=width, no_color=console.no_color, soft_wrap=True).print(renderable)
