"""A sweep's report: ``trials.md`` and the loss-vs-clipping figure (artifacts), and the terminal table."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from sweep.pick import TABLE_COLUMNS, Pick
from sweep.report.format import fmt, frame_markdown, pct, print_wide, ui_command
from sweep.report.plots import plot_sweep

if TYPE_CHECKING:
    from sweep.results.study import SweepResult
    from sweep.tracking.tracker import RunTracker

#: The trials table's columns (``sweep.pick.TABLE_COLUMNS``) a report shows: all but the bookkeeping ones.
SWEEP_COLUMNS = tuple(c for c in TABLE_COLUMNS if c not in ("wall_s", "parent_run_id"))
_SHORT = {
    "trial": "#",
    "state": "state",
    "dtype": "dtype",
    "max_norm": "τ",
    "eval_loss": "eval",
    "clip_ratio": "clip",
    "skip_ratio": "skip",
    "final_loss": "train",
    "steps_run": "steps",
}
_STATE = {
    "COMPLETE": "done",
    "PRUNED": "pruned",
    "FAIL": "failed",
    "KILLED": "killed",
    "RUNNING": "running",
    "DIED": "died",
    "WAITING": "queued",
}


def write_sweep_report(tracker: RunTracker, result: SweepResult) -> None:
    """``trials.md`` and ``plots/loss_vs_clip_ratio.png`` into the parent run's artifacts."""
    tracker.artifact_path("trials.md").write_text(
        sweep_markdown(result.study_name, result.trials, result.pick, band=result.band, mode=result.mode)
    )
    plot_sweep(
        result.trials,
        result.pick,
        tracker.artifact_path("plots/loss_vs_clip_ratio.png"),
        band=result.band,
        anchor=result.anchor,
        title=f"{result.study_name} ({result.mode})",
    )


def sweep_markdown(
    study_name: str, df, pick: Pick | None, *, band: tuple[float, float], mode: str = "", heading: str = "##"
) -> str:
    """One study as markdown: the pick and its rule, then the trials table (Pareto / in-band marked)."""
    shown = df[[c for c in SWEEP_COLUMNS if c in df.columns]].copy()
    if "run_id" in shown:
        shown["run_id"] = shown["run_id"].astype(str).str[:8]
    states = df["state"].value_counts().to_dict() if len(df) else {}
    lines = [
        f"{heading} Study `{study_name}`" + (f" ({mode})" if mode else ""),
        "",
        f"- trials: {len(df)} (" + ", ".join(f"{v} {k.lower()}" for k, v in states.items()) + ")",
        f"- target clipping band: [{band[0]:g}, {band[1]:g}]",
    ]
    if pick is not None:
        lines += [
            f"- **pick: trial {pick.trial}: `{pick.override()}`** "
            f"(eval loss {fmt(pick.eval_loss)}, clipping ratio {pct(pick.clip_ratio)})",
            f"- rule `{pick.rule}`: {pick.reason}",
        ]
    else:
        lines.append("- pick: none (no completed trial yet)")
    lines += ["", frame_markdown(shown) if len(shown) else "no trials", ""]
    return "\n".join(lines)


def sweep_table(df, pick: Pick | None, title: str, *, pareto: bool = True) -> Table:
    """Compact terminal table; ``marks``: P = on the Pareto front (``pareto``: a two-objective study;
    a constrained one has no front), B = clipping ratio in the band, ★ = pick."""
    t = Table(
        title=title,
        caption="eval: eval loss; train: mean training loss, last 10 steps; "
        f"marks: {'P Pareto front, ' if pareto else ''}B clipping ratio in the band, ★ pick",
    )
    cols = [c for c in _SHORT if c in df.columns]
    for c in cols:
        # fold, not "…": a number cut to fit a narrow console reads as another number (3.006… for 3.006e+04)
        t.add_column(_SHORT[c], justify="left" if c in ("state", "dtype") else "right", overflow="fold")
    t.add_column("marks", overflow="fold")
    for _, row in df.iterrows():
        cells = [
            pct(row[c])
            if c in ("clip_ratio", "skip_ratio") and isinstance(row[c], float) and not math.isnan(row[c])
            else _STATE.get(str(row[c]), str(row[c]).lower())
            if c == "state"
            else fmt(row[c])
            for c in cols
        ]
        picked = pick is not None and int(row["trial"]) == pick.trial
        marks = (
            ("P" if pareto and row.get("pareto", False) else "")
            + ("B" if row.get("in_band", False) else "")
            + ("★" if picked else "")
        )
        t.add_row(*cells, marks, style="bold green" if picked else None)
    return t


def no_pick_line(result: SweepResult) -> str:
    """Why a study has no pick and what to change: its trials were pruned above the band, or failed."""
    df, (low, high) = result.trials, result.band
    above = df[(df["state"] == "PRUNED") & (df["clip_ratio"] > high)]
    if len(df) == 0 or len(above) == 0:
        return "no completed trial: no pick"
    keys = (
        "study.anchor_low/anchor_high (τ in [anchor_low × p50, anchor_high × p99] of the window)"
        if result.anchor
        else "study.max_norm_low/max_norm_high"
    )
    return (
        f"no completed trial: no pick: {len(above)} of {len(df)} trials clipped more than the band's "
        f"{pct(high)} allows (pruned above [{pct(low)}, {pct(high)}]: τ up to {fmt(above['max_norm'].max())} is "
        f"below this task's gradient norms); search larger τ: raise {keys}, or widen study.target_clip"
    )


def print_sweep_summary(result: SweepResult, *, uri: str, experiment_id: str, console: Console | None = None) -> None:
    """Terminal: the study's trials, the pick and its rule, pruning accounting, the UI command."""
    console = console or Console()
    title = f"Study {result.study_name} ({result.mode})"
    print_wide(console, sweep_table(result.trials, result.pick, title, pareto=result.mode == "pareto"))
    p = result.pick
    if p is not None:
        console.print(
            f"[bold green]Pick: trial {p.trial}: {p.override()}[/] (eval loss {fmt(p.eval_loss)}, "
            f"clipping ratio {pct(p.clip_ratio)}); rule {p.rule}: {p.reason}"
        )
    else:
        console.print(no_pick_line(result))
    console.print(
        f"this invocation: {result.trials_run} trials ({result.pruned} pruned, {result.failed} failed) in "
        f"{result.wall_s:.0f} s; trial-steps run {result.steps_run} of {result.steps_budget} unpruned "
        f"(saved {result.steps_saved}, ≈{result.seconds_saved_est:.0f} s; pruning checks "
        f"{result.prune_overhead_s:.2f} s)"
    )
    console.print(
        f"Optuna study {result.study_name!r} in {result.storage}; MLflow parent run "
        f"{result.parent_run_id}: {ui_command(uri, experiment_id)}"
    )
