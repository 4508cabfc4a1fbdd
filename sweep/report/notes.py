"""Descriptions the MLflow UI shows: each run's (its answer, then ``report.md``) and the experiment's
(the latest answer on the first line, then the threshold table across runs), both markdown in the
``mlflow.note.content`` tag. The experiment's is refreshed after each run."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from sweep.commands import python_command
from sweep.report.format import fmt, frame_markdown, pct
from sweep.report.runs import frame, table
from sweep.report.unfinished import fill, legend
from sweep.run.summary import tau_tags
from sweep.tracking.outbox import unreachable
from sweep.tracking.ui import NOTE_TAG

if TYPE_CHECKING:
    from sweep.run.pipeline import RunResult
    from sweep.tracking.tracker import RunTracker

#: Said beside the recommended τ of a run without a calibration window (a train run, a sweep trial).
NO_WINDOW = "no calibration window: a quantile of every step's norm, warm-up included; a calibrate run validates τ"
RUN_NOTE_MAX = 8000  # MLflow's longest run tag value
EXPERIMENT_NOTE_MAX = 20000  # and experiment tag value
TABLE_ROWS = 40  # newest runs in the experiment's table


def _fit(text: str, limit: int, tail: str) -> str:
    """``text`` cut at a line boundary (with ``tail`` appended) to at most ``limit`` characters."""
    if len(text) <= limit:
        return text
    return text[: text.rfind("\n", 0, limit - len(tail) - 1)] + "\n" + tail


def run_note(result: RunResult, report: str) -> str:
    """The answer (recommended τ, p95, τ used per phase, ratios, the validation verdict), then ``report``."""
    m = result.metrics
    taus = tau_tags(result.records.rows)
    per_phase = ", ".join(f"{k[len('tau.') :]} {v}" for k, v in taus.items() if k.startswith("tau."))
    windowed = result.calibration is not None and bool(result.calibration.summaries)
    lines = [
        f"**Recommended τ (`clip.max_norm`) = {fmt(m['recommended_max_norm'])}**"
        + ("" if windowed else f" ({NO_WINDOW})")
        + f" · p95 = {fmt(m['grad_norm_p95'])} · τ used: {per_phase} · clipped {pct(m['clip_ratio'])} · "
        f"skipped {pct(m['skip_ratio'])}",
        "",
    ]
    check = result.calibration.checks()[0] if result.calibration is not None and result.calibration.summaries else None
    if check is not None:
        lines += [f"**Verdict:** {check.verdict}. Next: {check.action}.", ""]
    return _fit("\n".join(lines) + "\n" + report, RUN_NOTE_MAX, "… (the whole report: artifact `report.md`)")


#: The ``sweep_role`` tag of a study's internal anchor-window run (``sweep.experiments.study.space``).
ANCHOR_ROLE = "anchor"


def experiment_note(runs, shown=None) -> str:
    """The newest answer on one line (the newest run with a calibration window, else the newest with a
    recommended τ, said to have none), then the table of the newest runs (``shown``: those runs with what
    ``sweep.report.unfinished.fill`` gives unfinished ones, and its legend). A study's anchor window (tag
    ``sweep_role=anchor``) is the study's own measurement, never the answer."""
    answered = (
        runs[runs["metrics.recommended_max_norm"].notna()] if "metrics.recommended_max_norm" in runs else runs[:0]
    )
    if "tags.sweep_role" in answered:
        answered = answered[answered["tags.sweep_role"] != ANCHOR_ROLE]
    window = "metrics.window_clip_ratio_at_tau"
    windowed = answered[answered[window].notna()] if window in answered else answered[:0]
    lines = []
    if len(answered):
        r = (windowed if len(windowed) else answered).iloc[0]
        tau_used = r.get("tags.tau_used") or "—"
        lines.append(
            f"Latest: **{r['tags.mlflow.runName']}**: recommended τ (`clip.max_norm`) "
            f"**{fmt(r['metrics.recommended_max_norm'])}**"
            + ("" if len(windowed) else f" ({NO_WINDOW})")
            + f", p95 {fmt(r.get('metrics.grad_norm_p95', math.nan))}, "
            f"τ used {tau_used}, clipped {pct(r.get('metrics.clip_ratio', math.nan))}"
        )
    else:
        lines.append("No run with a recommended τ yet.")
    lines += [
        "",
        f"## Threshold report: the {min(len(runs), TABLE_ROWS)} newest of {len(runs)} runs",
        "",
        "τ used: the clipping threshold each phase trained at; τ rec.: the recommended `clip.max_norm`; "
        f"clipped/skipped: share of steps. `{python_command('sweep.report')}` prints the whole table.",
        "",
        frame_markdown(table(runs.head(TABLE_ROWS) if shown is None else shown)),
    ]
    lines += [] if shown is None else legend(shown, limit=None, markdown=True)
    return _fit("\n".join(lines), EXPERIMENT_NOTE_MAX, f"… (`{python_command('sweep.report')}` prints every run)")


def write_notes(tracker: RunTracker, result: RunResult, report: str) -> None:
    """Set the run's description, then refresh the experiment's from every run in the store."""
    tracker.set_tags({NOTE_TAG: run_note(result, report)})
    try:
        runs = frame(tracker.client.tracking_uri, tracker.experiment_id)
        # as sweep.report shows them, from the steps.csv files on this disk: a run's end downloads none
        shown = fill(runs.head(TABLE_ROWS), tracker.client.tracking_uri, tracker.client, download=False)
        tracker.client.set_experiment_tag(tracker.experiment_id, NOTE_TAG, experiment_note(runs, shown))
    except Exception as e:  # a tracking server that is away: the next run refreshes the experiment's
        if not unreachable(e):
            raise
