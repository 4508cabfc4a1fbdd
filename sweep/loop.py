"""The per-step loop shared by every experiment: step, record (CSV row + batched metrics), progress."""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from clipamp_engine import AmpTrainState, StepCSVWriter, StepLog

#: Extra CSV columns the app writes after the canonical eight.
APP_COLUMNS = ("clipped", "token_count", "max_norm", "phase", "data_source", "grad_l2_token_normalised")

#: Per-step metrics sent to MLflow (batched).
STEP_METRICS = ("loss", "grad_l2_pre_clip", "grad_l2_post_clip", "lr", "scaler_scale", "max_norm")


@dataclass
class RunRecords:
    """Rows of one run kept in memory for summaries and plots (small: one dict per step)."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def taken(self, phase: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.rows if not r["skipped"] and (phase is None or r["phase"] == phase)]

    def clip_ratio(self, phase: str | None = None) -> float:
        taken = self.taken(phase)
        return sum(bool(r["clipped"]) for r in taken) / len(taken) if taken else math.nan

    def skip_ratio(self) -> float:
        return sum(bool(r["skipped"]) for r in self.rows) / len(self.rows) if self.rows else math.nan

    def final_loss(self, last: int = 10) -> float:
        """Mean training loss over the last ``last`` taken steps."""
        losses = [r["loss"] for r in self.taken() if math.isfinite(r["loss"])][-last:]
        return sum(losses) / len(losses) if losses else math.nan


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so both end a run the same clean way."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def progress_bar(enabled: bool, label: str) -> Progress:
    return Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"), disable=not enabled, transient=False)


def run_steps(
    state: AmpTrainState,
    batches: Iterator,
    steps: range,
    *,
    writer: StepCSVWriter,
    tracker: Any,
    records: RunRecords,
    phase_of: Callable[[int], str] = lambda step: "train",
    on_record: Callable[[StepLog], None] | None = None,
    progress: bool = True,
    label: str = "train",
) -> None:
    """Run ``steps`` (1-based step numbers) through ``state``, recording every step as it ends."""
    with progress_bar(progress, label) as bar:
        task = bar.add_task(label, total=len(steps), info="")
        for step in steps:
            batch = next(batches)
            log = state.step(batch.inputs, batch.targets)
            tok = log.token_count
            row = log.with_extra(
                phase=phase_of(step), data_source=batch.data_source,
                grad_l2_token_normalised=log.grad_l2_pre_clip * math.sqrt(tok) if tok else None).row()
            writer.write(row)
            records.rows.append(row)
            tracker.add_step(log.step, {k: row[k] for k in STEP_METRICS} | {"clipped": float(log.clipped)})
            if on_record is not None:
                on_record(log)
            if bar.tasks and (step % 10 == 0 or step == steps[-1]):
                bar.update(task, completed=step - steps[0] + 1,
                           info=f"loss {log.loss:.3f}  |g| {log.grad_l2_pre_clip:.3g}  τ {log.max_norm or float('nan'):.3g}")
    tracker.flush()
