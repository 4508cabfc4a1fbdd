"""The lines a ``StepRecorder`` says about its calibration windows: where the first lies and why, a
quantile's interval, each window's check at the end, and why a run ended with none (what places one)."""

from __future__ import annotations

import math

from clipamp_engine.clip.calibrated import CalibratedClip


def placement_line(policy: CalibratedClip) -> str:
    """Where the first window lies and why (``start=auto``: the warm-up and settling it waited for, or the
    run's length that left no room to), as the app's report says it, in the host's spelling."""
    sp = policy.spelling
    start = sp.set("start", sp.auto if policy.start == "auto" else policy.start)
    return f"window placement ({start}): {policy.placement.reason}"


def no_window(policy: CalibratedClip) -> str:
    """Why a run ended before its first window held two norms, and what places one."""
    if policy.placement is not None:
        return f"the {policy.window}-step window starts at step {policy.placement.start}"
    detector, sp = policy.detector, policy.spelling
    waited = "the LR was still rising" if detector.warmup_end is None else "the norms had not settled"
    if policy.total_steps is None:  # no deadline: the window waits for the warm-up and the transient
        return (
            f"{waited} and the run's length is unknown, so {sp.set('start', sp.auto)} waits on: give its length "
            f"({sp.name('length')}) to place the window within it, or {sp.set('start', 'N')}"
        )
    return f"{waited}; the window would have started by step {detector.latest} (the run ended before)"


def check_lines(policy: CalibratedClip) -> list[str]:
    """Each closed window's check at the run's end: its τ, the verdict and the next action."""
    checks = enumerate(policy.checks(), 1)
    return [f"window {i} τ={c.tau:.4g}: {c.verdict}; next: {c.action}" for i, c in checks if c is not None]


def interval(ci) -> str:
    """A quantile's interval; a side the window is too short to bound says so."""
    if ci.bounded:
        return f"interval [{ci.low:.4g}, {ci.high:.4g}]"
    low = f"{ci.low:.4g}" if math.isfinite(ci.low) else "unbounded"
    high = f"{ci.high:.4g}" if math.isfinite(ci.high) else "unbounded"
    return f"interval [{low}, {high}]: the window is too short to bound it"
