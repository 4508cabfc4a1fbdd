"""Feed a logged norm series through the engine's ``CalibratedClip``: the runner's procedure, step by step.

The policy a ``clip=calibrated`` run trains with (``clipamp_engine.clip.calibrated``) decides where
the window starts (``clipamp_engine.placement``), summarises it (``NormCalibrator``: quantiles with
order-statistic intervals, the clipping ratio of each candidate τ), adopts τ = Quantile_q, counts how
often τ clips the later steps for the band check (``clipamp_engine.band``) and compares windows for
drift. It only ever sees records, so the same object fed one ``StepLog`` per logged step gives the
runner's τ for that series by construction: a step counts as clipped when the coefficient
τ / (‖g‖ + 1e-6) that ``GlobalNormClip`` would apply is below 1, as in a run.

A series logged every N steps is replayed on its own step numbers, with the window, the spacing of
windows and the validation span rounded to multiples of N (and a fixed start shifted by < N) so that
every window ends on a logged step, where the policy closes it.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from clipamp_engine.calibration import CalibrationError
from clipamp_engine.clip.calibrated import RECOMMENDED, CalibratedClip
from clipamp_engine.norms import CLIP_EPS
from clipamp_engine.records import SkipLog, StepLog
from clipamp_engine.spelling import Spelling
from sweep.errors import UserError
from sweep.recommend.series import NormSeries


@dataclass(frozen=True)
class Options:
    """``CalibratedClip``'s arguments (the runner's ``calibrate.*``), all in training steps; the defaults are
    ``RECOMMENDED``'s, those of ``+experiment=calibrate`` and of the trainer integrations, so that one
    series gets the same advice from every entry point."""

    window: int = RECOMMENDED["window"]
    every: int = RECOMMENDED["every"]
    quantile: float | None = RECOMMENDED["quantile"]  # None: aim at the middle of target_clip
    candidates: Sequence[float] = RECOMMENDED["candidates"]
    start: int | str = RECOMMENDED["start"]
    validate: int = RECOMMENDED["validate"]
    target_clip: Sequence[float] = RECOMMENDED["target_clip"]
    confidence: float = RECOMMENDED["confidence"]


#: The ``Options`` a run logs as ``calibrate.<name>`` params (the app's config, the trainer integrations'
#: ``recorder.options``): for an MLflow run they are this command's defaults (``run_options``).
RUN_SETTINGS = ("window", "every", "quantile", "start", "validate", "target_clip", "candidates", "confidence")
#: The advice's settings as this command takes them: its flags (``--start 200``, ``--quantile band``), the log's
#: length, and the ``max_grad_norm`` its last line writes in each trainer's terms.
RECOMMEND_SPELLING = Spelling(
    threshold="max_grad_norm",
    length="the log's length",
    **{k: f"--{k}" for k in ("start", "window", "every", "validate", "quantile")},
    named="{}",
    assign="{} {}",
    auto="auto",
    band="band",
    lengthen="raise",
)


def run_settings(params: dict[str, str]) -> dict[str, Any]:
    """A run's ``calibrate.*`` params as ``Options`` values (``'None'`` quantile: the band's; ``'auto'`` or a
    step count for start; a list or tuple for the band and candidates); a value of another shape is left out."""
    out: dict[str, Any] = {}
    for name in RUN_SETTINGS:
        text = params.get(f"calibrate.{name}")
        if text is None:
            continue
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text.strip()
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if name in ("target_clip", "candidates"):
            if isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
                out[name] = tuple(float(v) for v in value)
        elif name == "quantile":
            if value is None or number:
                out[name] = None if value is None else float(value)
        elif name == "confidence":
            if number:
                out[name] = float(value)
        elif name == "start" and value == "auto":
            out[name] = value
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            out[name] = value
    return out


def as_flag(name: str, value: Any) -> str:
    """An option as this command's flag: ``--window 60``, ``--quantile band``, ``--target-clip 0.01 0.05``."""
    if name == "quantile" and value is None:
        value = "band"
    elif isinstance(value, list | tuple):
        value = " ".join(f"{v:g}" for v in value)
    return f"--{name.replace('_', '-')} {value}".rstrip()  # an empty list: the flag alone


_OPTION = re.compile(rf"\b({'|'.join(RUN_SETTINGS)})=(\[[^\]]*\]|[^\s,;)]+)")


def as_flags(message: str) -> str:
    """``CalibratedClip``'s message with its arguments written as this command's flags (``every=30`` →
    ``--every 30``, ``target_clip=[0.5, 0.1]`` → ``--target-clip 0.5 0.1``): the options the user typed."""

    def flag(m: re.Match) -> str:
        return as_flag(m[1], m[2][1:-1].replace(",", "") if m[2].startswith("[") else m[2])

    return _OPTION.sub(flag, message)


def on_grid(options: Options, series: NormSeries) -> tuple[Options, list[str]]:
    """``options`` with every window ending on a logged step of a series logged every N steps, and a note
    per value that moved."""
    n = series.interval
    if n <= 1:
        return options, []
    window = max(2, round(options.window / n)) * n
    every = max(window, round(options.every / n) * n) if options.every else 0
    validate = max(n, round(options.validate / n) * n) if options.validate else 0
    start = options.start
    if start != "auto":
        start = start + (int(series.steps[-1]) - start - window) % n  # the window's last step is logged
    grid = dataclasses.replace(options, window=window, every=every, validate=validate, start=start)
    notes = [
        f"--{name} {getattr(options, name)} → {getattr(grid, name)} (a multiple of the logging interval {n}, so that "
        f"each window ends on a logged step)"
        for name in ("window", "every", "validate")
        if getattr(grid, name) != getattr(options, name)
    ]
    if grid.start != options.start:
        notes.append(f"--start {options.start} → {grid.start}: the window then ends on a logged step")
    return grid, notes


def _lrs(series: NormSeries) -> np.ndarray | None:
    """The LR per logged step, gaps filled from the previous value; ``None`` without any LR."""
    if series.lrs is None or not np.isfinite(series.lrs).any():
        return None
    return pd.Series(series.lrs).ffill().bfill().to_numpy()


def record(step: int, lr: float, norm: float, taken: bool, tau: float | None, tokens: float = math.nan) -> StepLog:
    """The record a run would have written for this step while clipping at ``tau`` (``None``: no clipping),
    with its token count where the log has one."""
    count = int(tokens) if math.isfinite(tokens) and tokens > 0 else None
    if not taken:
        return SkipLog(step, lr, norm, math.nan, math.nan, 1.0, clipped=False, token_count=count, max_norm=tau)
    coef = 1.0 if tau is None else min(1.0, tau / (norm + CLIP_EPS))
    return StepLog(step, lr, norm, norm * coef, math.nan, 1.0, clipped=coef < 1.0, token_count=count, max_norm=tau)


def replay(series: NormSeries, options: Options) -> CalibratedClip:
    """The ``CalibratedClip`` of a run of ``series.total_steps`` (else ``series.steps[-1]``) steps that saw
    ``series``'s norms: the window placed as the live run placed it, with the run's end in view (none for an
    ``open_ended`` series, whose run knew no end).

    A run resumed with another length (``series.earlier_lengths``) is replayed as it ran: the policy of each
    length continues from the one before, as a resume restores it (``CalibratedClip.load_state_dict``).

    Without an LR in the logs every record's LR is NaN: the placement sees no warm-up, and says so.

    Raises:
        UserError: an option ``CalibratedClip`` refuses, or a window it cannot summarise.
    """
    final = None if series.open_ended else max(series.total_steps or 0, int(series.steps[-1]))
    lengths = [*series.earlier_lengths, (math.inf, final)]
    clip = _policy(options, lengths[0][1])
    lrs = _lrs(series)
    lrs = np.full(len(series.steps), math.nan) if lrs is None else lrs  # no LR: the placement says so
    tokens = np.full(len(series.steps), math.nan) if series.tokens is None else series.tokens
    try:
        logged = zip(series.steps.tolist(), lrs.tolist(), series.norms.tolist(), series.taken, tokens.tolist())
        for step, lr, norm, taken, count in logged:
            while step > lengths[0][0]:  # resumed after that step for a run of another length
                lengths.pop(0)
                resumed = _policy(options, lengths[0][1])
                resumed.load_state_dict(clip.state_dict())
                clip = resumed
            clip.observe(record(step, lr, norm, bool(taken), clip.threshold, count))
    except CalibrationError as e:
        raise UserError(f"{series.source}: {e}") from None
    return clip


def _policy(options: Options, total_steps: int | None) -> CalibratedClip:
    try:
        return CalibratedClip(
            options.window,
            options.every,
            options.quantile,
            tuple(options.candidates),
            None,
            options.start,
            options.validate,
            tuple(options.target_clip),
            options.confidence,
            total_steps=total_steps,
            spelling=RECOMMEND_SPELLING,
        )
    except ValueError as e:
        raise UserError(as_flags(str(e))) from None


def early_stop(clip: CalibratedClip, series: NormSeries) -> list[str]:
    """A run read with its own settings whose log ends inside its first window: that window's norms so far
    give τ, as the run's own end gave it (an integration's ``end``, ``CalibratedClip.close_early``); the
    note that says so (none where it holds fewer than two finite norms)."""
    open_since = clip.windows.window_at(int(series.steps[-1])) if clip.windows is not None else None
    try:
        closed = clip.close_early()
    except CalibrationError as e:
        raise UserError(f"{series.source}: {e}") from None
    if not closed:
        return []
    s = clip.summaries[0]
    window = f" (steps {open_since[0]}–{open_since[-1]})" if open_since is not None else ""
    return [
        f"the log ends at step {int(series.steps[-1])}, inside its first window{window}: τ is that window's so far "
        f"({s.n_finite} norms, steps {s.start_step}–{s.end_step}), as the run's end took it"
    ]


def window_norms(series: NormSeries, start: int, end: int) -> np.ndarray:
    """The finite, taken norms logged in steps ``start``..``end`` (what the window's quantiles are of)."""
    inside = (series.steps >= start) & (series.steps <= end) & series.taken
    return series.norms[inside]


def diagnosis_rows(series: NormSeries) -> list[dict[str, Any]]:
    """The rows ``clipamp_engine.diagnosis.diagnose`` reads: the log's own (clipamp's CSV), else built from
    the series with the run's τ where the logs carry it. A step whose logged norm is text is left out: the cell
    says nothing of the gradient, so it is no non-finite step."""
    unreadable = series.unreadable if series.unreadable is not None else np.zeros(len(series.steps), dtype=bool)
    if series.rows is not None:
        return [r for r, bad in zip(series.rows, unreadable) if not bad]
    lrs = series.lrs if series.lrs is not None else np.full(len(series.steps), np.nan)
    tau = series.max_norm if series.max_norm is not None else np.full(len(series.steps), np.nan)
    post = series.post if series.post is not None else np.full(len(series.steps), np.nan)
    skipped = ~series.taken
    return [
        {
            "step": int(s),
            "lr": float(lr),
            "grad_l2_pre_clip": float(x),
            "skipped": bool(k),
            "skip_reason": "nonfinite_grad" if k else "",
            "max_norm": float(t) if math.isfinite(t) else None,
            "grad_l2_post_clip": float(p),
        }
        for s, lr, x, k, t, p, bad in zip(series.steps, lrs, series.norms, skipped, tau, post, unreadable)
        if not bad
    ]


def lone_norm_window(clip: CalibratedClip, steps: np.ndarray) -> list[str]:
    """A later window cut by the log's end that holds one logged norm: dropped, with the note that says so.

    The run drops a window the end cuts to one step, since a quantile of one norm says nothing
    (``CalibrationWindows``); a 1-in-N log's cut window can span steps enough for the run and still hold one
    norm (steps 598–600 of a log every 3 steps), whose "τ" would be that norm. The first window is never
    dropped: what the log holds of it is said where it is cut (``outcome_notes``).
    """
    if len(clip.summaries) < 2 or clip.summaries[-1].n_finite >= 2:
        return []
    span = clip.windows.window_at(clip.summaries[-1].end_step)
    if span is None:
        return []
    logged = int(((steps >= span[0]) & (steps <= span[-1])).sum())  # ``steps``: the replayed log's
    if len(span) == clip.window or logged >= 2:  # a whole window, or one of a non-finite norm: the run's too
        return []
    clip.summaries.pop()
    clip.validation.pop()
    return [
        f"the last window (steps {span[0]}–{span[-1]}, cut by the log's end) holds one logged norm: not summarised, "
        f"as a quantile of one norm says nothing; τ in force at the end is the window before's"
    ]
