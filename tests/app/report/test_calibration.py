"""A calibrate run's calibration in quantiles.json, MLflow and the report agrees with the policy's state."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rich.console import Console

from clipamp_engine.calibration import window_for_width
from clipamp_engine.clip import CalibratedClip
from clipamp_engine.records import StepLog
from sweep.report.calibration import markdown, tables
from sweep.run.build import APP_SPELLING
from sweep.run.calibration import calibration_metrics as metrics
from sweep.run.calibration import calibration_payload as payload


def _driven(every=0, n=400, q=None, confidence=0.95, fall_after=None):
    rng = np.random.default_rng(0)
    steps = np.arange(1, n + 1)
    lrs = np.minimum(steps / 20, 1.0) * 3e-3
    norms = (1 + 9 * np.exp(-steps / 15)) * rng.lognormal(0, 0.3, n)
    if fall_after is not None:
        norms[fall_after:] *= 0.54  # the norms' level falls to 0.54× for good
    clip = CalibratedClip(
        window=100, every=every, start="auto", quantile=q, confidence=confidence, total_steps=n, spelling=APP_SPELLING
    )  # as a calibrate run builds it
    for s, lr, g in zip(steps, lrs, norms):
        tau = clip.threshold
        hit = tau is not None and g > tau
        clip.observe(
            StepLog(
                step=int(s),
                lr=float(lr),
                grad_l2_pre_clip=float(g),
                grad_l2_post_clip=float(min(g, tau) if hit else g),
                loss=2.0,
                scaler_scale=1.0,
                clipped=bool(hit),
                max_norm=tau,
            )
        )
    return clip


def test_payload_is_strict_json_and_matches_the_policy():
    clip = _driven(every=150)
    data = json.loads(json.dumps(payload(clip), allow_nan=False))
    assert data["placement"]["start"] == clip.placement.start and data["placement"]["rule"] == "auto"
    assert [w["recommended_max_norm"] for w in data["windows"]] == [s.recommended_max_norm for s in clip.summaries]
    assert [w["drift_from_previous"] for w in data["windows"]] == clip.drift()
    assert data["windows"][0]["band_check"]["clipped"] == clip.checks()[0].clipped


def test_metrics_carry_the_intervals_and_the_check():
    clip = _driven()
    m = metrics(clip)
    w, c = clip.summaries[0], clip.checks()[0]
    for k in ("p50", "p90", "p95"):
        assert m[f"grad_norm_{k}_ci_low"] <= w.quantiles[k] <= m[f"grad_norm_{k}_ci_high"]
    assert "grad_norm_p99_ci_high" not in m  # 100 norms cannot bound p99 from above
    assert m["window_start"] == clip.placement.start and m["warmup_end"] == 21
    assert m["predicted_clip_ratio"] == w.predicted_clip_ratio
    assert m["validation_clip_ratio"] == pytest.approx(c.clipped / c.steps)
    assert m["validation_within_2x"] == float(c.within_2x)


def test_report_and_terminal_show_placement_intervals_verdict_and_drift():
    clip = _driven(every=150)
    text = "\n".join(markdown(clip))
    assert clip.placement.reason in text and "95% interval" in text and "p97 from 100 norms" in text
    assert clip.checks()[0].verdict in text and "## Drift across windows" in text
    console = Console(record=True, width=200)
    for r in tables(clip):
        console.print(r)
    out = console.export_text()
    assert "window placement (calibrate.start=auto)" in out and "validation:" in out and "drift:" in out
    last = clip.summaries[-1]
    assert (
        f"latest window, steps {last.start_step}–{last.end_step}: clip.max_norm={last.recommended_max_norm:.4g}, "
        "the τ in force at the end; "
    ) in out  # the headline is the first window's τ: which τ a run ended at is said too
    assert ("train on from here at this τ" in out) == any(clip.drift())


def _terminal(clip) -> str:
    console = Console(record=True, width=200)
    for r in tables(clip):
        console.print(r)
    return console.export_text()


def test_windows_too_short_to_bound_tau_say_they_cannot_judge_drift_not_that_there_is_none():
    """Norms that fall to 0.54× after the first window: with Quantile_0.97 of 100 norms every τ interval reaches
    +∞ and overlaps every other, so the run cannot tell; it said "no drift: the first window's τ holds"."""
    short = _driven(every=150, n=450, fall_after=250)
    assert not any(short.drift()) and not short.summaries[0].tau_ci.bounded
    out = _terminal(short)
    assert "no drift" not in out  # before: "no drift: the first window's τ holds"
    assert "2 cannot separate: a τ interval with no upper bound (Quantile_0.97 of 100 norms) overlaps every" in out
    assert "windows too short to judge drift (interval ±∞), so nothing says whether the first window's τ holds" in out
    assert "| cannot |" in "\n".join(markdown(short))
    # the same norms judged at Quantile_0.9, which 100 norms bound: the fall separates the intervals
    bounded = _driven(every=150, n=450, q=0.9, fall_after=250)
    assert any(bounded.drift()) and "train on from here at this τ" in _terminal(bounded)


def test_no_drift_is_said_with_the_width_it_could_resolve():
    clip = _driven(every=150, n=450, q=0.9)
    assert not any(clip.drift())
    md = markdown(clip)
    table = md[md.index("## Drift across windows") + 4 :][:3]
    # "interval separate?": the first window has no previous one to separate from (it read "no")
    assert [row.split(" | ")[4] for row in table] == ["—", "no", "no"]
    width = max(s.tau_ci.rel_width for s in clip.summaries) / 2
    assert f"no drift beyond the windows' intervals (±{width:.0%}): the first window's τ holds" in _terminal(clip)


def test_the_intervals_are_labelled_at_the_level_they_were_computed_at():
    clip = _driven(every=150, confidence=0.8)
    text = "\n".join(markdown(clip))
    assert "80% interval" in text and "95%" not in text
    assert text.count("80% interval") == 4  # the quantile table, the recommendation, the verdict, the drift table
    console = Console(record=True, width=200)
    for r in tables(clip):
        console.print(r)
    out = console.export_text()
    assert "80% interval" in out and "95%" not in out


def test_a_window_that_ends_the_run_says_nothing_checked_its_tau():
    """steps = calibrate.window: the policy has no held-out step (``checks()[0]`` is None); the terminal says
    so, as report.md and ``python -m sweep.recommend`` do, instead of dropping the validation line."""
    clip = _driven(n=100)
    assert clip.summaries and clip.checks()[0] is None
    console = Console(record=True, width=200)
    for r in tables(clip):
        console.print(r)
    out = console.export_text()
    assert "validation: none" in out and "nothing checks τ against the band" in out
    assert "No validation step after the window" in "\n".join(markdown(clip))


def _window_of(norms, per: int) -> CalibratedClip:
    """A policy whose one window of ``per × len(norms)`` steps holds ``norms``, each after ``per − 1`` skipped
    steps (a refused update: no norm for the window), then 50 steps at τ."""
    from sweep.recommend.replay import record

    window = per * len(norms)
    clip = CalibratedClip(window=window, start=0, quantile=0.9, total_steps=window + 50)
    step = 0
    for g in [*norms, *np.full(50, 0.5)]:
        for _ in range(per - 1 if step < window else 0):
            step += 1
            clip.observe(record(step, 1e-3, np.nan, False, clip.threshold))
        step += 1
        clip.observe(record(step, 1e-3, float(g), True, clip.threshold))
    return clip


def _window_cells(clip: CalibratedClip) -> dict[str, str]:
    rows = [line.split(" | ") for line in markdown(clip) if line.startswith("| p")]
    return {cells[0].lstrip("| "): cells[3] for cells in rows}


def test_the_window_a_narrower_interval_needs_is_counted_in_steps():
    """The same 100 norms, logged every step or each after a skipped step (a 200-step window): the
    intervals, and the norms a ±10% interval or a bound needs, are the same; the window (calibrate.window,
    in steps) is twice as long in the second, and the column says so rather than repeat the norm count."""
    norms = np.random.default_rng(0).lognormal(0, 1.0, 100)
    every, skipped = _window_of(norms, 1), _window_of(norms, 2)
    assert skipped.summaries[0].n_finite == every.summaries[0].n_finite == 100
    assert skipped.summaries[0].n_skipped == 100
    ci = every.summaries[0].cis["p50"]
    need = window_for_width(ci.n, ci.rel_width, 0.2)  # the norms a ±10% interval needs: 1/√n extrapolation
    assert need > 100
    one, two = _window_cells(every), _window_cells(skipped)
    assert one["p50"] == f"{need} steps"
    assert two["p50"] == f"{2 * need} steps ({need} norms)"
    assert one["p99"] == "≥ 368 norms for a bound" and two["p99"] == "≥ 368 norms (≈ 736 steps) for a bound"
    wide = Console(width=200, record=True)
    for r in tables(skipped):
        wide.print(r)
    assert f"{2 * need} steps ({need} norms)" in wide.export_text()
