"""A logged gradient-norm series, and what it can and cannot say about a clipping threshold.

Every reader (``sweep.recommend.readers``) returns a ``NormSeries``: the steps, the norms, the learning
rate when the logs carry it, and the τ the run clipped at when they carry that. The checks here state
the limits of such a series before any quantile is taken:

- **sampling**: a norm logged every N steps is a 1-in-N sample of the run's norms. The order-statistic
  interval of a quantile (``clipamp_engine.calibration.quantile_ci``) still holds for the norms'
  distribution over a stationary stretch, but from the n = W/N norms a W-step window holds, so it is
  about √N times as wide as an every-step log of the same window gives (Conover 1999, §3.2), and a
  one-step spike is in the log with probability 1/N;
- **post-clip**: a norm measured after clipping at τ never exceeds τ and piles up at it, so its
  quantiles cannot see the tail a threshold is chosen from (``post_clip_reason``);
- **smoothing**: a running mean hides the per-step spread the quantile measures; its first
  differences are nearly uncorrelated, where per-step norms' differences are anti-correlated
  (lag-1 correlation −(1 − ρ)/2 for an AR(1) series with autocorrelation ρ), so a lag-1 correlation
  of the differences above −0.1 reads as smoothed (``smoothing_note``). The differences are of the
  log norms: a warm-up multiplies the norms' level, and over a sparse log (HF's logging_steps=10) its
  absolute drops would dominate the correlation and read as smoothing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from clipamp_engine.calibration import CONFIDENCE, DEFAULT_QUANTILE, min_window, quantile_label
from sweep.errors import UserError

#: Names that hold a norm measured after clipping (clipamp's CSV and MLflow runs).
POST_CLIP_NAMES = ("grad_l2_post_clip",)
#: A logged post-clip norm lies within this of τ: the clip coefficient τ / (‖g‖ + 1e-6) leaves it
#: at most 1e-6 below τ, and float32 logs round it by a few 1e-7 relative.
_AT_TAU_ABS, _AT_TAU_REL = 2e-6, 1e-5


@dataclass
class NormSeries:
    """One run's logged norms, sorted by step, one value per step (the last one logged wins).

    ``lrs``: the learning rate at each step (``None``: the logs carry none). ``max_norm``: the τ the
    run clipped at per step (NaN where unknown). ``skipped``: steps whose update the run refused.
    ``rows``: the log's own per-step rows when it has the columns ``diagnose`` reads (clipamp's CSV).
    ``pre_clip``: why the series is known to be measured before clipping (``None``: assumed).
    ``lr_name``: the tag, column or metric the LR came from. ``tokens``: the token count of each step
    (NaN where unknown; ``None``: the log has none), for the quantiles of ‖g‖·√N_tok. ``settings``: the
    calibration options the run itself logged (its ``calibrate.*`` params, by ``Options`` field name), read
    from ``settings_from`` (an MLflow run's params, or the config beside a CSV).
    ``total_steps``: the run's planned length where the log says (a Trainer state's ``max_steps``), which a
    checkpoint taken mid-run logs past its last step (``None``: the log's last step). ``post``: the norm after
    clipping (clipamp's MLflow ``grad_l2_post_clip``), which tells the diagnosis the steps the run clipped.
    ``open_ended``: the run's calibration knew no length (a trainer integration given none, as its
    ``steps.clipamp.yaml`` says): the window is placed with no end in view, as the run placed it.
    ``earlier_lengths``: ``(through_step, total_steps)`` of each length the run's calibration knew before a resume
    changed it (Trainer's ``max_steps``), as its settings file lists them.
    ``unreadable``: steps whose logged norm is text, not a number (``None``: none is): skipped by the
    calibration, left out of the diagnosis, since the cell says nothing about the gradient.
    """

    source: str
    name: str
    steps: np.ndarray
    norms: np.ndarray
    lrs: np.ndarray | None = None
    max_norm: np.ndarray | None = None
    skipped: np.ndarray | None = None
    rows: list[dict[str, Any]] | None = None
    pre_clip: str | None = None
    lr_name: str | None = None
    notes: list[str] = field(default_factory=list)
    tokens: np.ndarray | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    settings_from: str | None = "the run's calibrate.* params"
    total_steps: int | None = None
    post: np.ndarray | None = None
    open_ended: bool = False
    unreadable: np.ndarray | None = None
    earlier_lengths: list[tuple[int, int | None]] = field(default_factory=list)

    @property
    def interval(self) -> int:
        """The logging interval N: the most common gap between logged steps (1 for a single point)."""
        gaps = np.diff(self.steps)
        if not len(gaps):
            return 1
        values, counts = np.unique(gaps, return_counts=True)
        return int(values[np.argmax(counts)])

    @property
    def taken(self) -> np.ndarray:
        """Steps whose norm is finite and whose update was not refused."""
        ok = np.isfinite(self.norms)
        return ok if self.skipped is None else ok & ~self.skipped


_MASKS = ("skipped", "unreadable")


def make_series(
    source: str, name: str, steps, norms, lrs=None, *, lightning: str | None = None, **extra: Any
) -> NormSeries:
    """A ``NormSeries`` from parallel sequences: sorted by step, a repeated step (a resumed run logs
    some again) keeps its last value. ``lightning``: why the log is Lightning's (``lightning_marks``), whose
    steps are read one higher whatever its logging interval; a log whose steps start at 0 is too.
    ``extra``: the other ``NormSeries`` fields (arrays aligned with ``steps``, or plain values)."""
    steps = np.asarray(steps, dtype=np.int64)
    if not len(steps):
        raise UserError(f"{source}: {name} holds no value: pass a log with at least one logged norm")
    order = np.argsort(steps, kind="stable")
    last = np.r_[steps[order][1:] != steps[order][:-1], True]  # the last of each run of equal steps
    keep = order[last]
    arrays = {"lrs": lrs, **{k: extra.pop(k, None) for k in ("max_norm", "skipped", "tokens", "post", "unreadable")}}
    kept = {k: None if v is None else np.asarray(v)[keep] for k, v in arrays.items()}
    rows = extra.pop("rows", None)
    series = NormSeries(
        source,
        name,
        steps[keep],
        np.asarray(norms, dtype=np.float64)[keep],
        rows=None if rows is None else [rows[i] for i in keep],
        **{k: None if v is None else v.astype(bool if k in _MASKS else np.float64) for k, v in kept.items()},
        **extra,
    )
    if len(keep) < len(steps):
        series.notes.append(f"{len(steps) - len(keep)} repeated step(s) (a resumed run?): the last value logged kept")
    zero_based = zero_based_grid(series.steps)
    if lightning or zero_based:  # Lightning logs at global_step before the update: optimizer step k as k - 1
        series.steps = series.steps + 1
        why = (
            f"a Lightning log ({lightning}): Lightning logs at trainer.global_step, before the update"
            if lightning
            else zero_based
        )
        series.notes.append(
            f"{why}, so optimizer step k is logged as k − 1; read as optimizer steps "
            f"{series.steps[0]}–{series.steps[-1]}, as clipamp and Trainer number them"
        )
    return series


def zero_based_grid(steps: np.ndarray) -> str | None:
    """Why the sorted ``steps`` count from 0, else ``None``: they start at 0, or every N-th step is logged at
    N − 1, 2N − 1, … (N ≥ 2; the last may be off the grid: the run's end), as a counter from 0 logged when
    ``(step + 1) % N == 0`` is (Lightning's ``log_every_n_steps``, whatever the log's names). A log counted from 1
    every N steps sits at N, 2N, …"""
    if steps[0] == 0:
        return "the log numbers its steps from 0 (as Lightning's global_step and nanoGPT's iter do)"
    grid = steps[:-1] if len(steps) > 2 else steps
    spacing = np.diff(grid)
    n = int(spacing[0]) if len(spacing) else 0
    if n < 2 or (spacing != n).any() or ((grid + 1) % n != 0).any():
        return None
    return (
        f"the log's steps are {n - 1}, {2 * n - 1}, … (a count from 0 logged every {n} steps, as Lightning's "
        "log_every_n_steps logs its global_step)"
    )


#: Lightning's own names: its ``grad_norm`` utility's total (``grad_2.0_norm_total``) and ``LearningRateMonitor``'s.
_LIGHTNING_NAMES = re.compile(r"grad_[\w.]+_norm_total|lr-[A-Za-z]\w*(/pg\d+)?")


def lightning_marks(names, folder=None) -> str | None:
    """Why a log whose columns, tags or metrics are ``names`` is Lightning's, else ``None``: Lightning adds
    ``epoch`` to every metric it logs, and its ``grad_norm`` and ``LearningRateMonitor`` names, or the
    ``hparams.yaml`` its loggers write beside the log in ``folder``, tell it from another loop's ``epoch``."""
    names = list(names)
    if "epoch" not in names:
        return None
    own = next((n for n in names if _LIGHTNING_NAMES.fullmatch(n)), None)
    if own is not None:
        return f"its epoch and {own}"
    if folder is not None and (folder / "hparams.yaml").is_file():
        return "its epoch and the hparams.yaml beside it"
    return None


def post_clip_reason(series: NormSeries) -> str | None:
    """Why ``series`` was logged after clipping (and so cannot calibrate), or ``None``.

    Post-clip when its name says so, or when every finite norm is ≤ the τ in force and at least one
    sits at τ (clipping at τ puts the clipped steps there); without a known τ, when ≥ 3 norms (and
    ≥ 1%) sit at the series' maximum, where a clipped series piles up.
    """
    if series.name in POST_CLIP_NAMES:
        return f"{series.name} is the norm after clipping: read grad_l2_pre_clip instead (--norm grad_l2_pre_clip)"
    ok = series.taken
    x = series.norms[ok]
    if not len(x):
        return None
    tau = series.max_norm[ok] if series.max_norm is not None else np.full(len(x), np.nan)
    known = np.isfinite(tau) & (tau > 0)
    if known.all():
        at = np.abs(x - tau) <= _AT_TAU_ABS + _AT_TAU_REL * tau
        if (x <= tau + _AT_TAU_ABS + _AT_TAU_REL * tau).all() and at.any():
            return (
                f"every {series.name} is ≤ the run's max_grad_norm ({_taus(tau)}) and {int(at.sum())} of "
                f"{len(x)} sit at it: the series was logged after clipping, its tail above τ is gone and a "
                f"quantile of it cannot exceed τ; log the norm clip_grad_norm_ returns (it is the pre-clip one)"
            )
        return None
    top = x.max()
    at = np.abs(x - top) <= _AT_TAU_ABS + _AT_TAU_REL * top
    if at.sum() >= 3 and at.mean() >= 0.01:
        return (
            f"{int(at.sum())} of {len(x)} values of {series.name} sit at its maximum {top:.6g}, where a norm "
            f"logged after clipping at max_grad_norm={top:.6g} piles up: it cannot calibrate; log the norm "
            f"clip_grad_norm_ returns (it is the pre-clip one)"
        )
    return None


def _taus(tau: np.ndarray) -> str:
    lo, hi = float(tau.min()), float(tau.max())
    return f"{lo:.4g}" if lo == hi else f"{lo:.4g}–{hi:.4g}"


def unclipped_note(series: NormSeries) -> str | None:
    """A note when the run's τ is known and never clipped a logged step (pre- and post-clip agree)."""
    ok = series.taken
    if series.max_norm is None or not ok.any():
        return None
    tau = series.max_norm[ok]
    if not (np.isfinite(tau) & (tau > 0)).all() or not (series.norms[ok] < tau).all():
        return None
    return (
        f"every logged norm is below the run's max_grad_norm ({_taus(tau)}): it never clipped a logged step, "
        f"so pre- and post-clip norms agree there"
    )


def smoothing_note(series: NormSeries, min_points: int = 20) -> str | None:
    """A warning when the series looks like a running mean (module docstring), else ``None``."""
    x = series.norms[series.taken]
    x = x[x > 0]
    if len(x) < min_points:
        return None
    d = np.diff(np.log(x))  # relative changes: a warm-up's decay over a sparse log does not swamp the noise
    if d.std() == 0:
        return None
    r = float(np.corrcoef(d[:-1], d[1:])[0, 1])
    if not math.isfinite(r) or r <= -0.1:
        return None
    return (
        f"{series.name} changes smoothly (lag-1 correlation of its step-to-step changes {r:+.2f}; per-step "
        f"norms give about −0.5): if it is a running mean (an EMA or a mean over the logging interval), "
        f"its quantiles understate the spread and τ comes out too low; log the per-step norm"
    )


def sampling_note(
    series: NormSeries, window: int, q: float = DEFAULT_QUANTILE, auto: bool = False, confidence: float = CONFIDENCE
) -> str | None:
    """What a 1-in-N log does to the window's statistics (module docstring), or ``None`` for N = 1.
    ``q``: the quantile τ is read from; ``auto``: the window placement is ``start=auto``, whose rolling
    median counts logged norms; ``confidence``: the intervals' level."""
    n = series.interval
    if n <= 1:
        return None
    gaps = np.unique(np.diff(series.steps))
    uneven = f" (gaps vary: {', '.join(map(str, gaps[:6]))}{' …' if len(gaps) > 6 else ''})" if len(gaps) > 1 else ""
    per_window = window // n
    return (
        f"{series.name} is logged every {n} steps{uneven}: a 1-in-{n} sample of the run's norms. A {window}-step "
        f"window holds {per_window} norms, so its quantile intervals are those of {per_window} norms (about "
        f"{math.sqrt(n):.1f}× as wide as a log of every step), clipping ratios are estimated from them, the "
        f"validation counts logged steps only and a one-step spike is in the log with probability 1/{n}; "
        f"a {quantile_label(q)} interval at {confidence * 100:.4g}% needs ≥ {min_window(q, confidence)} norms, "
        f"--window ≥ {min_window(q, confidence) * n}"
        + (
            f"; --start auto's rolling median spans 20 logged norms ({20 * n} steps) and waits 20 of them"
            if auto
            else ""
        )
    )


def with_gaps_skipped(series: NormSeries) -> tuple[NormSeries, int]:
    """``series`` with a skipped, non-finite value at every step of its logging grid (every N steps,
    ending at its last step) that holds none, and how many were added.

    A window closes on its last step, so that step must be in the series; a step with no value is
    counted as skipped, as a run counts a step it refused (clipamp's MLflow runs store no
    non-finite norm, so their gaps are exactly those steps).
    """
    n, steps = series.interval, series.steps
    last = int(steps[-1])
    grid = np.arange(last - (last - int(steps[0])) // n * n, last + 1, n)
    missing = np.setdiff1d(grid, steps)
    if not len(missing):
        return series, 0
    order = np.argsort(np.r_[steps, missing], kind="stable")
    gap = np.full(len(missing), np.nan)

    def merged(values, fill):
        return None if values is None else np.r_[values, fill][order]

    skipped = series.skipped if series.skipped is not None else np.zeros(len(steps), dtype=bool)
    filled = dataclasses.replace(
        series,
        steps=np.r_[steps, missing][order],
        norms=merged(series.norms, gap),
        lrs=merged(series.lrs, gap),
        max_norm=merged(series.max_norm, gap),
        post=merged(series.post, gap),
        tokens=merged(series.tokens, gap),
        skipped=merged(skipped, np.ones(len(missing), dtype=bool)),
        unreadable=merged(series.unreadable, np.zeros(len(missing), dtype=bool)),
        rows=None,
        notes=list(series.notes),
    )
    return filled, len(missing)


#: Cells a log writes for a missing or non-finite value (``pd.to_numeric`` reads them as NaN): not text.
NAN_SPELLINGS = {"nan", "-nan", "+nan", "none", "null", "na", "n/a"}


def text_cells(source: str, name: str, cells: pd.Series, values: pd.Series, steps) -> tuple[list[str], np.ndarray]:
    """Cells of the norm column that are text, not numbers (``tensor(0.69)``, a stray word): an error naming
    one when the column holds no number, else a note (the calibration reads them as skipped steps, as a logged
    ``nan`` is; the diagnosis leaves them out: a cell of text is no overflow), and their mask."""
    text = values.isna() & ~cells.str.strip().str.lower().isin(NAN_SPELLINGS)
    if not text.any():
        return [], text.to_numpy()
    i = int(np.flatnonzero(text.to_numpy())[0])
    example = f"{cells.iloc[i].strip()!r} at step {int(np.asarray(steps)[i])}"
    if values.isna().all():
        raise UserError(
            f"{source}: column {name!r} holds no number (e.g. {example}): log the norm as a number (float(norm), "
            "norm.item()), or pass --norm COLUMN of another column"
        )
    return [
        f"{int(text.sum())} cell(s) of {name!r} are text, not numbers (e.g. {example}): read as skipped steps, "
        "left out of the diagnosis (they say nothing of the gradient)"
    ], text.to_numpy()
