"""A calibrate run's windows for people: ``report.md`` lines and terminal renderables.

From the run's ``CalibratedClip`` (the same object ``sweep.run.calibration`` turns into metrics
and ``quantiles.json``): where the window was and why, each quantile's order-statistic interval
at the policy's ``confidence`` (and the window, in steps, a ±10% interval needs), the τ adopted, predicted vs realised
clipping on the validation steps with the verdict and next action, and the drift between windows. The
settings it names are spelled as the policy's front end writes them (``clip.spelling``: the app's overrides
in a calibrate run, ``python -m sweep.recommend``'s flags in a recommendation).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rich.table import Table

from clipamp_engine.calibration import min_window, window_for_width

if TYPE_CHECKING:
    from clipamp_engine.calibration import QuantileCI
    from clipamp_engine.clip import CalibratedClip

#: the relative interval width whose window length the report estimates
TARGET_REL_WIDTH = 0.2


def _f(v: float | None) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{v:.4g}"


def _interval(ci) -> str:
    return (
        f"[{_f(ci.low)}, {_f(ci.high)}]"
        if ci.bounded
        else (f"[{_f(ci.low)}, no bound]" if math.isfinite(ci.low) else f"[no bound, {_f(ci.high)}]")
    )


def _level(clip: CalibratedClip) -> str:
    """The intervals' level as the headings say it: ``95%``, ``80%``, ``99.5%``."""
    return f"{clip.confidence * 100:.4g}%"


def _start(clip: CalibratedClip) -> str:
    """The policy's ``start`` as its front end writes it: ``calibrate.start=auto``, ``--start 200``."""
    sp = clip.spelling
    return sp.set("start", sp.auto if clip.start == "auto" else clip.start)


def _needs(ci, per_norm: float = 1.0) -> str:
    """The window a bound, or a ±10% interval, needs: counted in norms by the statistics, said in steps
    (the ``window`` option's unit) at the window's own ``per_norm`` steps per finite norm, which skipped
    steps and a log sampled every N steps raise above 1."""
    if not ci.bounded:
        need = min_window(ci.q, ci.confidence)
        more = f" (≈ {math.ceil(need * per_norm - 1e-9)} steps)" if per_norm > 1 else ""
        return f"≥ {need} norms{more} for a bound"
    need = window_for_width(ci.n, ci.rel_width, TARGET_REL_WIDTH)
    if not (need and need > ci.n):
        return "—"
    return f"{math.ceil(need * per_norm - 1e-9)} steps" + (f" ({need} norms)" if per_norm > 1 else "")


def per_norm(clip: CalibratedClip, w) -> float:
    """A window's steps per finite norm (1 when every step is logged and taken)."""
    span = clip.windows.window_at(w.end_step) if clip.windows is not None else None
    length = len(span) if span is not None else w.end_step - w.start_step + 1
    return max(1.0, length / w.n_finite) if w.n_finite else 1.0


def steps(clip: CalibratedClip, w) -> str:
    """A window's steps as the policy placed them (``491–690``), not its first logged step: on a log
    sampled every N steps the first norm a window holds can be up to N − 1 steps after its start."""
    span = clip.windows.window_at(w.end_step) if clip.windows is not None else None
    return f"{span[0] if span is not None else w.start_step}–{w.end_step}"


def markdown(clip: CalibratedClip) -> list[str]:
    """Report lines: placement, the first window's quantiles with intervals, the check, drift."""
    lines, sp = [], clip.spelling
    if clip.placement is not None:
        lines += [f"**Window placement** (`{_start(clip)}`): {clip.placement.reason}.", ""]
    if not clip.summaries:
        return lines + ["No calibration window closed in this run.", ""]
    w = clip.summaries[0]
    lines += [
        f"## Calibration window: steps {steps(clip, w)} ({w.n_finite} finite norms, {w.n_skipped} skipped)",
        "",
        f"| quantile | ‖g‖ | {_level(clip)} interval | window for a ±10% interval | ‖g‖·√N_tok |",
        "|---|---|---|---|---|",
    ]
    for k, v in w.quantiles.items():
        ci = w.cis.get(k)
        lines.append(
            f"| {k} | {_f(v)} | {_interval(ci) if ci else ''} | {_needs(ci, per_norm(clip, w)) if ci else ''} "
            f"| {_f(w.token_quantiles.get(k, math.nan))} |"
        )
    lines += [""] + [f"> warning: {x}" for x in w.warnings] + ([""] if w.warnings else [])
    lines += ["| threshold τ | clipping ratio in the window |", "|---|---|"]
    for t, r in w.candidate_clip_ratios.items():
        lines.append(f"| {t:.4g} | {r:.1%}{' ← recommended' if t == w.recommended_max_norm else ''} |")
    lines += [
        "",
        f"**Recommended `{sp.set('threshold', f'{w.recommended_max_norm:.4g}')}`** (τ = Quantile_{w.quantile:.4g} of "
        f"the window's finite pre-clip norms, {_level(clip)} interval {_interval(w.tau_ci)}; target band "
        f"[{clip.band[0]:.0%}, {clip.band[1]:.0%}]).",
        "",
    ]
    check = clip.checks()[0]
    if check is not None:
        lines += [
            "## Validation on held-out steps",
            "",
            f"- {check.verdict}",
            f"- within 2× of the prediction: {'yes' if check.within_2x else 'no'}",
            f"- next: {check.action}",
            "",
        ]
    else:
        lines += [
            f"No validation step after the window: {sp.longer_run()} (or lower {sp.name('window')}).",
            "",
        ]
    if len(clip.summaries) > 1:
        lines += [
            "## Drift across windows",
            "",
            f"| window | τ | {_level(clip)} interval | τ / previous | interval separate? | validation |",
            "|---|---|---|---|---|---|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in _window_rows(clip, drift="**drift**")]
        lines.append("")
    return lines


def tables(clip: CalibratedClip) -> list[Any]:
    """Terminal renderables: the window's quantiles with intervals, candidates, the verdict lines."""
    out: list[Any] = []
    sp = clip.spelling
    if clip.placement is not None:
        out.append(f"window placement ({_start(clip)}): {clip.placement.reason}")
    if not clip.summaries:
        return out
    w = clip.summaries[0]
    t = Table(title=f"Calibration window, steps {steps(clip, w)} ({w.n_finite} finite, {w.n_skipped} skipped)")
    for col in ("quantile", "‖g‖", f"{_level(clip)} interval", "window for ±10%", "‖g‖·√N_tok"):
        t.add_column(col, justify="right")
    for k, v in w.quantiles.items():
        ci = w.cis.get(k)
        t.add_row(
            k,
            _f(v),
            _interval(ci) if ci else "",
            _needs(ci, per_norm(clip, w)) if ci else "",
            _f(w.token_quantiles.get(k, math.nan)),
        )
    out.append(t)
    out += [f"[yellow]warning:[/] {x}" for x in w.warnings]
    c = Table(title="Candidate thresholds")
    c.add_column("τ", justify="right")
    c.add_column("clipping ratio in window", justify="right")
    for tau, r in w.candidate_clip_ratios.items():
        c.add_row(_f(tau) + (" ←" if tau == w.recommended_max_norm else ""), f"{r:.1%}")
    out.append(c)
    out.append(
        f"[bold green]Recommended {sp.set('threshold', f'{w.recommended_max_norm:.4g}')}[/] "
        f"(Quantile_{w.quantile:.4g}, {_level(clip)} interval {_interval(w.tau_ci)})"
    )
    check = clip.checks()[0]
    if check is not None:
        colour = "green" if check.inside else "yellow"
        out += [f"[{colour}]validation:[/] {check.verdict}", f"next: {check.action}"]
    else:
        out.append(
            "[yellow]validation:[/] none: no step after the window, so nothing checks τ against the band "
            f"({sp.longer_run()}, or lower {sp.name('window')} or {sp.name('start')})"
        )
    if len(clip.summaries) > 1:
        out.append(_drift_table(clip))
        out += drift_lines(clip)
    return out


def separable(a: QuantileCI, b: QuantileCI) -> bool:
    """Whether two τ intervals could separate at all: one's upper side and the other's lower side bounded (a
    window too short to bound τ from above gives an interval reaching +∞, which every later one overlaps)."""
    return (math.isfinite(a.high) and math.isfinite(b.low)) or (math.isfinite(b.high) and math.isfinite(a.low))


def drift_lines(clip: CalibratedClip) -> list[str]:
    """The drift count and the latest window's line: drift, no drift beyond the intervals' width, or windows
    too short to judge it (intervals that cannot separate say nothing about drift)."""
    sp = clip.spelling
    drifted = [s for s, d in zip(clip.summaries, clip.drift()) if d]
    blind = sum(not separable(a.tau_ci, b.tau_ci) for a, b in zip(clip.summaries, clip.summaries[1:]))
    first = clip.summaries[0]
    count = f"drift: {len(drifted)} of {len(clip.summaries) - 1} later windows have a τ interval separate from the "
    count += "previous one" + (f" (from steps {steps(clip, drifted[0])})" if drifted else "")
    if blind:
        count += (
            f"; {blind} cannot separate: a τ interval with no upper bound (Quantile_{first.quantile:.4g} of "
            f"{first.n_finite} norms) overlaps every other"
        )
    if drifted:
        verdict = "the norms moved, so train on from here at this τ, not the first window's"
    elif blind:
        verdict = (
            "windows too short to judge drift (interval ±∞), so nothing says whether the first window's τ holds: "
            f"lengthen {sp.name('window')} until the quantile table bounds τ"
        )
    else:
        width = max(s.tau_ci.rel_width for s in clip.summaries) / 2
        verdict = f"no drift beyond the windows' intervals (±{width:.0%}): the first window's τ holds"
    last = clip.summaries[-1]
    return [
        count,
        f"latest window, steps {steps(clip, last)}: {sp.set('threshold', f'{last.recommended_max_norm:.4g}')}, "
        "the τ in force "
        f"at the end; {verdict}",
    ]


def _drift_table(clip: CalibratedClip) -> Table:
    """Every window's τ with its interval, its ratio to the previous one and its own validation."""
    t = Table(title=f"Windows ({clip.spelling.name('every')})")
    for col in ("window", "τ", f"{_level(clip)} interval", "τ / previous", "separate?", "validation"):
        t.add_column(col, justify="right")
    for row in _window_rows(clip, drift="drift"):
        t.add_row(*row)
    return t


def _window_rows(clip: CalibratedClip, drift: str) -> list[tuple[str, ...]]:
    """Per window: its steps, τ, τ's interval, τ / the previous τ, ``drift``, "no" or "cannot" (intervals that
    cannot separate, ``separable``; "—" for the first window, which has no previous one), its validation."""
    rows, prev = [], None
    for s, d, c in zip(clip.summaries, clip.drift(), clip.checks()):
        blind = prev is not None and not separable(prev.tau_ci, s.tau_ci)
        rows.append(
            (
                steps(clip, s),
                _f(s.recommended_max_norm),
                _interval(s.tau_ci),
                f"{s.recommended_max_norm / prev.recommended_max_norm:.2f}" if prev else "—",
                "—" if prev is None else drift if d else "cannot" if blind else "no",
                f"{c.realised:.1%} vs {c.predicted:.1%}" if c else "—",
            )
        )
        prev = s
    return rows
