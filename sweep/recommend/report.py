"""A recommendation for people: what the series can tell, then the runner's own calibration report.

The window placement, the quantile table with intervals, the candidate thresholds and their clipping
ratios, the recommended τ, the band verdict on the steps after the window and the drift across
windows are ``sweep.report.calibration``'s renderings of the ``CalibratedClip`` (the ones a calibrate
run prints, the settings they name spelled as this command's flags: ``replay.RECOMMEND_SPELLING``); the
diagnosis is ``clipamp_engine.diagnosis`` over the logged series.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from clipamp_engine.band import band_quantile
from clipamp_engine.clip.calibrated import CalibratedClip
from clipamp_engine.diagnosis import Finding, format_findings
from sweep.recommend.replay import Options
from sweep.recommend.series import NormSeries, sampling_note, smoothing_note, unclipped_note
from sweep.report import calibration


@dataclass
class Recommendation:
    """One series, the options it was replayed with (on its logging grid), the replayed policy, findings."""

    series: NormSeries
    options: Options
    clip: CalibratedClip
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """The τ of the first window: the recommended ``max_grad_norm``."""
        return self.clip.summaries[0].recommended_max_norm


def caveats(series: NormSeries, options: Options) -> list[str]:
    """What the series can and cannot tell: pre-clip or assumed so, sampling, LR, smoothing, reading notes."""
    s = series
    out = [
        s.pre_clip
        or f"{s.name} is taken as the pre-clip norm (the value clip_grad_norm_ returns): a norm logged "
        f"after clipping, or a running mean of it, cannot calibrate"
    ]
    q = options.quantile if options.quantile is not None else band_quantile(tuple(options.target_clip))
    sampled = sampling_note(s, options.window, q, auto=options.start == "auto", confidence=options.confidence)
    out += [n for n in (unclipped_note(s), sampled, smoothing_note(s)) if n]
    first = int(s.steps[0])
    if first > max(1, s.interval):
        out.append(
            f"the log starts at step {first}: steps before it are not in it, so --start auto's 'warm-up over' step "
            f"is where the logged LR stopped rising (its second point if it never rises), not the run's warm-up; "
            f"pass the log from step 1 (every piece of a resumed run) or --start N"
        )
    if s.lr_name:
        out.append(f"LR from {s.lr_name}: the window placement reads the warm-up from it")
    elif options.start == "auto":
        out.append(
            "no learning rate in the log: --start auto cannot see a warm-up and waits only for the norms' "
            "rolling median to settle (counted from the log's second point); pass --lr NAME or --start N"
        )
    return out + s.notes


def outcome_notes(clip: CalibratedClip, options: Options) -> list[str]:
    """What the replay could not do: a first window cut by the end of the log, no step to check τ on."""
    out = []
    first = clip.summaries[0]
    span = clip.windows.window_at(first.end_step)
    if span is not None and len(span) < options.window:
        out.append(
            f"the window was cut at the log's end: steps {span[0]}–{span[-1]} instead of {options.window} "
            f"(lower --start or read a longer log)"
        )
    if clip.checks()[0] is None:
        out.append(
            "no logged step after the window: nothing checks τ against the band (lower --window or --start, "
            "or read a longer log)"
        )
    return out


def header(rec: Recommendation) -> str:
    s = rec.series
    taken = int(s.taken.sum())
    every = f", one every {s.interval} steps" if s.interval > 1 else ""
    skipped = f", {len(s.steps) - taken} non-finite or skipped" if taken < len(s.steps) else ""
    return f"{s.source}: {s.name}, {len(s.steps)} values over steps {s.steps[0]}–{s.steps[-1]}{every}{skipped}"


def print_report(rec: Recommendation, console: Console | None = None) -> None:
    """The terminal report: header, notes, the calibration tables, the diagnosis, the recommendation."""
    console = console or Console(soft_wrap=True)
    console.print(header(rec), markup=False, highlight=False)
    for note in rec.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    for renderable in calibration.tables(rec.clip):
        console.print(renderable)
    console.print(format_findings(rec.findings, markdown=False), markup=False, highlight=False)
    console.print(
        f"max_grad_norm={rec.tau:.4g}  (Trainer: TrainingArguments(max_grad_norm={rec.tau:.4g}); "
        f"Lightning: Trainer(gradient_clip_val={rec.tau:.4g}); torch: clip_grad_norm_(params, {rec.tau:.4g}); "
        f"clipamp: clip.max_norm={rec.tau:.4g})",
        markup=False,
        highlight=False,
    )


def markdown(rec: Recommendation) -> str:
    """``report.md`` of a recommendation run: the same content as the terminal report."""
    lines: list[Any] = [f"# clipamp recommend: {header(rec)}", ""]
    lines += [f"- {n}" for n in rec.notes] + [""]
    lines += calibration.markdown(rec.clip)
    lines += ["## Norm-pattern diagnosis", "", format_findings(rec.findings), ""]
    return "\n".join(lines)
