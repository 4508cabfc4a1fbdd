"""The per-step loop shared by every experiment: step, record (CSV row + batched metrics), progress."""

from __future__ import annotations

import math
import signal
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from clipamp_engine import AmpTrainState, SkipRateExceeded, StepCSVWriter, StepLog

#: Extra CSV columns the app writes after the canonical eight.
APP_COLUMNS = (
    "clipped",
    "token_count",
    "max_norm",
    "phase",
    "data_source",
    "grad_l2_token_normalised",
    "scaler_at_floor",
)

#: Per-step metrics sent to MLflow (batched): the series a user charts; every other column stays in steps.csv.
STEP_METRICS = ("loss", "grad_l2_pre_clip", "grad_l2_post_clip", "lr", "scaler_scale")
#: Steps behind the per-step ``clip_ratio_rolling`` metric.
ROLLING = 50


def clipped_share(taken: list[dict[str, Any]]) -> float:
    """What share of ``taken`` rows' clipping bound: their gradients (``clipped``); under ``clip=update``, their
    optimizer updates (``update_l2_post_clip < update_l2_pre_clip``: the gradient itself is never clipped);
    under ``clip=dpsgd``, their examples (the mean ``dp_clip_fraction``: each example's gradient is clipped, the
    batch's never). NaN with no row."""
    fractions = [f for r in taken if math.isfinite(f := r.get("dp_clip_fraction", math.nan))]
    if fractions:
        return sum(fractions) / len(fractions)
    updates = [r for r in taken if math.isfinite(r.get("update_l2_pre_clip", math.nan))]
    if updates:
        return sum(r["update_l2_post_clip"] < r["update_l2_pre_clip"] for r in updates) / len(updates)
    return sum(bool(r["clipped"]) for r in taken) / len(taken) if taken else math.nan


@dataclass
class RunRecords:
    """Rows of one run kept in memory for summaries and plots (small: one dict per step)."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def last_step(self) -> int | None:
        return self.rows[-1]["step"] if self.rows else None

    def taken(self, phase: str | None = None) -> list[dict[str, Any]]:
        return [r for r in self.rows if not r["skipped"] and (phase is None or r["phase"] == phase)]

    def clip_ratio(self, phase: str | None = None) -> float:
        """The share of taken steps whose gradient was clipped (``clipped_share``: of updates or examples
        under a policy that clips those)."""
        return clipped_share(self.taken(phase))

    def step_metrics(self, index: int = -1) -> dict[str, float | None]:
        """Row ``index``'s (default: the latest) per-step MLflow metrics: ``STEP_METRICS`` and
        ``clip_ratio_rolling``, the share of the taken steps among the ``ROLLING`` steps up to it that
        were clipped (NaN, hence not sent, when all were skipped)."""
        end = index % len(self.rows) + 1
        row = self.rows[end - 1]
        recent = [r for r in self.rows[max(0, end - ROLLING) : end] if not r["skipped"]]
        return {k: row[k] for k in STEP_METRICS} | {"clip_ratio_rolling": clipped_share(recent)}

    def skip_ratio(self) -> float:
        return sum(bool(r["skipped"]) for r in self.rows) / len(self.rows) if self.rows else math.nan

    def final_losses(self, last: int = 10) -> list[float]:
        """The finite training losses of the last ``last`` taken steps (fewer in a shorter run)."""
        return [r["loss"] for r in self.taken() if math.isfinite(r["loss"])][-last:]

    def final_loss(self, last: int = 10) -> float:
        """Mean training loss over the last ``last`` taken steps."""
        losses = self.final_losses(last)
        return sum(losses) / len(losses) if losses else math.nan


class StopRun(Exception):
    """Raised from an ``on_step`` callback to end a run early on purpose (e.g. a pruned trial).

    With deferred records the steps after the one that raised it may have run already: they are
    recorded (CSV, metrics) all the same, and ``late`` holds their records, which the callback did not see.
    """

    status = "KILLED"
    late: list[StepLog]


class RunInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM ended a run. ``finished`` says where: ``None``, at a step boundary of the loop
    (after writing a checkpoint); ``True``, in the end-of-run phase, which completed first (the run
    ended FINISHED); ``False``, in the end-of-run phase, cut short by a second signal (KILLED)."""

    def __init__(self, signum: int, step: int, finished: bool | None = None) -> None:
        super().__init__(f"{signal.Signals(signum).name} at step {step}")
        self.signum, self.step, self.finished = signum, step, finished


class StopRequest:
    """SIGINT/SIGTERM ask the loop to stop after the current step; a second signal interrupts at once.

    Stopping at a step boundary means a checkpoint never holds a half-applied update.
    """

    def __init__(self, agree: Callable[[bool], bool] = lambda flag: flag) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._agree = agree  # under torchrun: whether any rank was asked to stop

    def requested(self) -> int | None:
        """The signal that asks to stop at this step boundary (on every rank alike), else None."""
        if self._agree(self.signum is not None):
            return self.signum or signal.SIGTERM  # another rank got it (torchrun forwards SIGTERM)
        return None

    def _handler(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt(f"second signal {signum}")
        self.signum = signum

    def __enter__(self) -> StopRequest:
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
        except ValueError:  # not the main thread: signals stay with the caller
            self._previous.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._handler:  # a handler set meanwhile (a rank failing under torchrun) stays
                signal.signal(sig, handler)

    def pass_on(self) -> bool:
        """Hand a stop this request did not act on to an enclosing ``StopRequest`` (a sweep's); False if none."""
        outer = getattr(self._previous.get(signal.SIGINT), "__self__", None)
        if self.signum is None or not isinstance(outer, StopRequest):
            return False
        outer.signum = outer.signum or self.signum
        return True


def progress_bar(enabled: bool, label: str = "{task.description}", console: Any = None, every: int = 50) -> Progress:
    """The app's one progress display: label, bar, n/total, elapsed, and an ``info`` field per task.

    Outside a terminal (nohup, CI, Slurm) rich's live bar shows nothing until it stops, so there the
    display is ``ProgressLines``: one plain line every ``every`` steps instead.
    """
    bar = Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        disable=not enabled,
        transient=False,
    )
    return ProgressLines(bar.console, every) if enabled and not bar.console.is_terminal else bar


class ProgressLines(Progress):
    """Progress as plain lines: ``label  n/total  elapsed  info`` each time a task passes a multiple of
    ``every``, completes, or is updated with ``line=True`` (a new phase: a calibration window's first step,
    the first step after it)."""

    def __init__(self, console: Any, every: int) -> None:
        super().__init__(console=console, disable=True)
        self.every = max(1, every)
        self._shown: dict[Any, int] = {}

    def add_task(self, description: str, *args: Any, completed: float = 0, **fields: Any) -> Any:
        task_id = super().add_task(description, *args, completed=completed, **fields)
        self._shown[task_id] = int(completed)  # a task that starts part-way (a resumed run) shows what it adds
        return task_id

    def update(self, task_id: Any, *, line: bool = False, **fields: Any) -> None:
        super().update(task_id, **fields)
        task = self._tasks[task_id]
        done, shown = int(task.completed), self._shown.get(task_id, 0)
        finished = task.total is not None and done >= task.total > shown
        if done > shown and (line or finished or done // self.every > shown // self.every):
            self._shown[task_id] = done
            total = f"/{task.total:.0f}" if task.total is not None else ""
            info = task.fields.get("info", "")
            self.console.print(
                f"{task.description}  {done}{total}  {task.elapsed or 0:.0f}s  {info}".rstrip(),
                markup=False,
                highlight=False,
                soft_wrap=True,
            )

    def reset(self, task_id: Any, **fields: Any) -> None:
        super().reset(task_id, **fields)
        self._shown[task_id] = 0


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
    progress_every: int = 50,
    label: str = "train",
    stop: StopRequest | None = None,
    checkpoint: Callable[[int], None] | None = None,
    checkpoint_every: int = 0,
    flush_after: Callable[[int], bool] | None = None,
) -> None:
    """Run ``steps`` (1-based step numbers) through ``state``, recording every step.

    Records are materialised by the engine every ``state.log_every`` steps (every step on CPU)
    and then written in order: the CSV, MLflow and ``on_record`` see the same rows, later; a
    record's phase is read when it is written (a ``start=auto`` window is placed at a flush).
    After a step for which ``flush_after(step)`` holds (e.g. an eval step: ``on_record`` must see
    the model of that step), the pending records are flushed at the step boundary. Every
    ``checkpoint_every`` steps, and when ``stop`` was requested, the pending records are flushed and
    ``checkpoint(step)`` runs at the step boundary; a stop then raises ``RunInterrupted``.
    """
    # per step whose record is not out yet: its data source and floor flag (a device tensor until the flush)
    pending: deque[tuple[Any, torch.Tensor | bool]] = deque()
    phases: list[str] = []
    with progress_bar(progress, label, every=progress_every) as bar:
        # counted in the run's steps: a run resumed after step 8 of 400 shows 9/400, not 1/392
        task = bar.add_task(label, total=steps.stop - 1, completed=steps.start - 1, info="")

        def emit(logs: list[StepLog]) -> None:
            facts = [pending.popleft() for _ in logs]
            floors = host_flags([floor for _, floor in facts])
            stopped: StopRun | None = None
            for log, (source, _), at_floor in zip(logs, facts, floors):
                phase = phase_of(log.step)
                _record_step(log, phase, source, at_floor, writer, tracker, records)
                stopped = _seen(on_record, log, stopped)
                if bar.tasks:
                    _show(bar, task, log, phase, phases, log.step, steps.stop - 1, progress_every)
            if stopped is not None:
                raise stopped

        def kept(call: Callable[[], list[StepLog]], batch: Any = None) -> list[StepLog]:
            return _kept(call, state, pending, emit, batch)

        for step in steps:
            batch = next(batches)
            emit(kept(lambda: state.step_deferred(batch.inputs, batch.targets), batch))  # noqa: B023 (called at once)
            last = step == steps[-1]
            if flush_after is not None and flush_after(step) and not last:
                emit(kept(state.flush))
            signum = stop.requested() if stop is not None else None  # agreed by every rank under torchrun
            signum = None if last else signum  # a stop at the last step is left to the caller: nothing to resume
            if checkpoint is not None and (signum is not None or checkpoint_every and step % checkpoint_every == 0):
                if not last:  # the last step's checkpoint would be removed as the run ends
                    emit(kept(state.flush))
                    checkpoint(step)
                    tracker.flush()  # the store holds every step the checkpoint holds, whatever kills the run next
            if signum is not None:
                emit(kept(state.flush))
                tracker.flush()
                raise RunInterrupted(signum, step)
        emit(kept(state.flush))


def _seen(on_record: Callable[[StepLog], None] | None, log: StepLog, stopped: StopRun | None) -> StopRun | None:
    """``on_record(log)``, until it raises ``StopRun``: the records after that one (steps that ran
    before the stop was seen) join its ``late``. The stop, if any."""
    if stopped is not None:
        stopped.late.append(log)
    elif on_record is not None:
        try:
            on_record(log)
        except StopRun as e:
            stopped, e.late = e, []
    return stopped


def _kept(call: Callable[[], list[StepLog]], state: AmpTrainState, pending: deque, emit: Callable, batch: Any):
    """``call()``: a step (of ``batch``, whose facts join ``pending``) or a flush. An error raised by a
    flush carries its records (the alarm's, or a window's that could not calibrate): they are
    ``emit``-ted before it goes on."""
    try:
        logs = call()
    except (SkipRateExceeded, ValueError) as e:
        if getattr(e, "records", None) is None:  # refused before the step had a record
            raise
        if batch is not None:
            pending.append((batch.data_source, state.scaler.floor_flag()))
        emit(e.records)
        raise
    if batch is not None:
        pending.append((batch.data_source, state.scaler.floor_flag()))
    return logs


def host_flags(flags: list[torch.Tensor | bool]) -> list[bool]:
    """``flags`` (device tensors and bools, e.g. ``HysteresisScaler.floor_flag()`` of several steps) as
    bools, the tensors read in one transfer."""
    tensors = [f for f in flags if isinstance(f, torch.Tensor)]
    if not tensors:
        return [bool(f) for f in flags]
    values = iter(torch.stack(tensors).tolist())  # sync: the floor flags of a flush's steps, one transfer
    return [bool(next(values)) if isinstance(f, torch.Tensor) else bool(f) for f in flags]


def _show(
    bar: Progress, task: Any, log: StepLog, phase: str, phases: list[str], done: int, total: int, every: int
) -> None:
    """Update the display every 10 steps (each step if ``every`` < 10), at the end, and when the phase
    changes (a calibration window's first step; the first step after it, the first clipped at its τ), which
    outside a terminal gets its own line, at that step and with its phase, as ``steps.csv`` has them."""
    new_phase = phases[-1:] != [phase]
    phases[-1:] = [phase]
    if not (new_phase or done % 10 == 0 or done == total or every < 10):
        return
    mark = {"line": new_phase} if isinstance(bar, ProgressLines) else {}
    bar.update(
        task,
        completed=done,
        **mark,
        info=f"{phase}  loss {log.loss:.3f}  |g| {log.grad_l2_pre_clip:.3g}  τ "
        + ("none" if log.max_norm is None else f"{log.max_norm:.3g}"),  # none: not clipped (e.g. in a window)
    )


def _record_step(
    log: StepLog, phase: str, source: Any, at_floor: bool, writer: StepCSVWriter, tracker: Any, records: RunRecords
) -> None:
    """One materialised step: its CSV row, its in-memory row and its batched metrics."""
    tok = log.token_count
    row = log.with_extra(
        phase=phase,
        data_source=source,
        grad_l2_token_normalised=log.grad_l2_pre_clip * math.sqrt(tok) if tok else None,
        scaler_at_floor=at_floor,
    ).row()
    writer.write(row)
    records.rows.append(row)
    tracker.add_step(log.step, records.step_metrics())
