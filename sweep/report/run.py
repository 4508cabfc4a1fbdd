"""One run's report: ``report.md`` (an artifact), the terminal summary, and its plots."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from clipamp_engine.calibration import QUANTILE_KEYS
from clipamp_engine.diagnosis import diagnose, format_findings
from sweep.report import calibration
from sweep.report.format import fmt, markdown_table, pct, ui_command
from sweep.report.notes import write_notes
from sweep.report.plots import plot_run

if TYPE_CHECKING:
    from sweep.config.schema import Config
    from sweep.run.pipeline import RunResult
    from sweep.tracking.tracker import RunTracker


def write_run_report(cfg: Config, tracker: RunTracker, result: RunResult) -> None:
    """``report.md`` and (``tracking.plots``) the run's plots into its artifacts: the run pipeline's
    ``hooks.artifacts`` for every experiment. The run's and the experiment's descriptions in the MLflow UI
    follow (``sweep.report.notes``)."""
    report = run_report_markdown(cfg, result)
    tracker.artifact_path("report.md").write_text(report)
    if cfg.tracking.plots and result.records.rows:
        m = result.metrics
        q = {k: m[f"grad_norm_{k}"] for k in QUANTILE_KEYS if f"grad_norm_{k}" in m}  # not their intervals
        plot_run(
            result.records.rows,
            tracker.artifact_path("plots/x").parent,
            quantiles=q,
            recommended=m.get("recommended_max_norm"),
            title=f"({cfg.model.name}, {cfg.amp.dtype})",
        )
    write_notes(tracker, result, report)


def run_report_markdown(cfg: Config, result: RunResult) -> str:
    """The human report of one run: quantiles, candidate thresholds, recommendation, ratios."""
    m = result.metrics
    clip = "calibrated (calibrate.*)" if result.calibration is not None else cfg.clip.mode
    lines = [
        f"# clipamp {cfg.run}: {cfg.model.name} on {cfg.data.name}, {cfg.amp.dtype}",
        "",
        f"- steps: {cfg.steps}{_earlier(result.earlier_lengths)}, seed {cfg.seed}, clip: {clip}",
        f"- skipped steps: {int(m.get('steps_skipped', 0))} (skip ratio {pct(m['skip_ratio'])})",
        f"- final training loss (last 10 steps): {fmt(m['final_loss'])}, "
        f"eval loss: {fmt(m.get('eval_loss', math.nan))}",
        "",
    ]
    if result.calibration is not None:
        lines += calibration.markdown(result.calibration)
        lines += [
            f"Clipping ratio realised after the first window (every later step, at the τ in force): "
            f"{pct(m['clip_ratio'])}.",
            "",
        ]
    elif result.windows:
        lines += _windows_markdown(result)
    else:
        lines += ["## Norm quantiles over the run", ""]
        lines += [f"- {k[len('grad_norm_') :]}: {fmt(v)}" for k, v in m.items() if k.startswith("grad_norm_")]
        lines += [f"- clipping ratio: {pct(m['clip_ratio'])}", ""]
    findings = format_findings(diagnose(result.records.rows))
    if findings:
        lines += ["## Norm-pattern diagnosis", "", findings, ""]
    return "\n".join(lines)


def _earlier(lengths: list[dict]) -> str:
    """A resumed run's earlier lengths (MLflow's param ``steps`` keeps the first; the tags ``resumed.*`` these)."""
    if not lengths:
        return ""
    was = "; ".join(f"steps={e['total_steps']} through step {e['through_step']}" for e in lengths)
    return f" (resumed: {was}; MLflow tag resumed.total_steps, param steps the first length)"


def _windows_markdown(result: RunResult) -> list[str]:
    w, m = result.windows[0], result.metrics
    lines = [
        f"## Calibration window: steps {w.start_step}–{w.end_step} ({w.n_finite} finite norms, {w.n_skipped} skipped)",
        "",
        markdown_table(
            ["quantile", "‖g‖", "‖g‖·√N_tok"],
            [(k, v, w.token_quantiles.get(k, math.nan)) for k, v in w.quantiles.items()],
        ),
        markdown_table(
            ["threshold τ", "clipping ratio in the window"],
            [
                (t, f"{r:.1%}" + (" ← recommended" if t == w.recommended_max_norm else ""))
                for t, r in w.candidate_clip_ratios.items()
            ],
        ),
        f"**Recommended `clip.max_norm={w.recommended_max_norm:.4g}`** "
        f"(τ = Quantile_{w.quantile:g} of the window's finite pre-clip norms).",
        "",
        f"Clipping ratio realised after the window at that τ: {pct(m['clip_ratio'])}.",
        "",
    ]
    if len(result.windows) > 1:
        rows = [
            (
                f"{x.start_step}–{x.end_step}",
                x.quantiles["p50"],
                x.quantiles["p95"],
                x.recommended_max_norm,
                f"{x.recommended_max_norm / w.recommended_max_norm:.2f}",
            )
            for x in result.windows
        ]
        lines += ["## Drift across windows", "", markdown_table(["window", "p50", "p95", "τ", "τ / first τ"], rows)]
    return lines


def print_run_summary(result: RunResult, *, uri: str, experiment_id: str, console: Console | None = None) -> None:
    """Terminal: quantiles, candidate thresholds and their clipping ratios, the pick, the UI command."""
    console = console or Console()
    m = result.metrics
    if result.calibration is not None:
        for renderable in calibration.tables(result.calibration):
            console.print(renderable)
    elif result.windows:
        w = result.windows[0]
        t = Table(
            title=f"Calibration window, steps {w.start_step}–{w.end_step} ({w.n_finite} finite, {w.n_skipped} skipped)"
        )
        for col in ("quantile", "‖g‖", "‖g‖·√N_tok"):
            t.add_column(col, justify="right")
        for k, v in w.quantiles.items():
            t.add_row(k, fmt(v), fmt(w.token_quantiles.get(k, math.nan)))
        console.print(t)
        c = Table(title="Candidate thresholds")
        c.add_column("τ", justify="right")
        c.add_column("clipping ratio in window", justify="right")
        for tau, r in w.candidate_clip_ratios.items():
            c.add_row(fmt(tau) + (" ←" if tau == w.recommended_max_norm else ""), pct(r))
        console.print(c)
        console.print(
            f"[bold green]Recommended clip.max_norm={w.recommended_max_norm:.4g}[/] "
            f"(Quantile_{w.quantile:g}); clipping ratio realised after the window: {pct(m['clip_ratio'])}"
        )
    clipped = "" if result.windows else f"clipped {pct(m['clip_ratio'])}, "  # else: the validation line says it
    first = result.records.rows[0] if result.records.rows else {}  # the policy's columns are on every row
    if "dp_clip_fraction" in first:  # clip=dpsgd: each example's
        clipped = f"examples clipped {pct(m['clip_ratio'])} (mean dp_clip_fraction), "
    elif "update_l2_pre_clip" in first:  # clip=update: the update
        clipped = f"updates clipped {pct(m['clip_ratio'])} (update_l2_post_clip < update_l2_pre_clip), "
    taken = len(result.records.final_losses())
    over = (
        "the last 10 taken steps" if taken == 10 else f"all {taken} taken steps" if taken > 1 else f"{taken} taken step"
    )
    console.print(
        f"final loss {fmt(m['final_loss'])} (mean of {over}), eval loss "
        f"{fmt(m.get('eval_loss', math.nan))}, {clipped}skip ratio {pct(m['skip_ratio'])}",
        markup=False,
    )
    findings = format_findings(diagnose(result.records.rows), markdown=False)
    if findings:
        console.print(findings, markup=False, highlight=False)
    console.print(f"MLflow run {result.run_id}: {ui_command(uri, experiment_id)}")
