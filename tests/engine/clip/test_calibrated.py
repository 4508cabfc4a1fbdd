"""CalibratedClip: the app's calibration windows inside the engine, bit for bit, resumable from its state."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from clipamp_engine import AmpTrainState
from clipamp_engine.calibration import CalibrationError, CalibrationWindows, NormCalibrator
from clipamp_engine.clip import CalibratedClip, GlobalNormClip, NoClip, clip_mode_options, make_clip_policy
from clipamp_engine.placement import auto_window_start
from clipamp_engine.records import StepLog

TOTAL = 13
#: A longer run where ``total_steps`` only tells the policy the loop's length: the advice asks for both.
LOOP = "lengthen your loop to N steps and pass total_steps=N"
SKIP_STEPS = {2, 6}  # NaN inputs: refused before backward, inside the first and second windows


def _reference_windows(window: int, every: int, total: int) -> list[range]:
    """The app's ``sweep.session.window_ranges`` before the move (the behaviour to keep)."""
    starts = [1] + (list(range(1 + every, total + 1, every)) if every else [])
    windows = [range(s, min(s + window, total + 1)) for s in starts]
    return [w for w in windows if len(w) >= 2]


@pytest.mark.parametrize("window, every", [(2, 0), (3, 0), (5, 0), (2, 2), (3, 3), (3, 4), (5, 7)])
def test_windows_are_the_apps_windows(window, every):
    for total in range(1, 25):
        ref = _reference_windows(window, every, total)
        windows = CalibrationWindows(window, every, total)
        assert windows.ranges() == ref, total
        window_of = {s: w for w in ref for s in w}
        assert [windows.window_at(s) for s in range(0, total + 3)] == [window_of.get(s) for s in range(0, total + 3)]


def test_windows_without_a_run_length_never_end_early():
    windows = CalibrationWindows(3, 5)
    assert windows.window_at(10**6 + 1) == range(10**6 + 1, 10**6 + 4) and windows.window_at(10**6 + 4) is None
    with pytest.raises(ValueError, match="total_steps"):
        windows.ranges()


@pytest.mark.parametrize(
    "options, match",
    [
        ({"window": 1}, "window=1"),
        ({"window": 4, "every": 3}, "every=3"),
        ({"cap": 0}, "cap=0"),
        ({"quantile": 1.0}, "quantile=1.0"),
        ({"every": -1}, "every=-1"),
    ],
)
def test_bad_options_name_the_value(options, match):
    with pytest.raises(ValueError, match=match):
        make_clip_policy("calibrated", **options)


def test_registered_with_plain_options_and_total_steps_as_context():
    assert clip_mode_options("calibrated") == {
        "window": 100,
        "every": 0,
        "quantile": 0.95,
        "candidates": [0.5, 1.0, 2.0, 5.0],
        "cap": None,
        "start": 0,
        "validate": 0,
        "target_clip": [0.01, 0.05],
        "confidence": 0.95,
    }
    policy = make_clip_policy("calibrated", window=3, every=4, total_steps=TOTAL)
    assert policy.windows.ranges() == _reference_windows(3, 4, TOTAL)


# -- against the app's manual swap -------------------------------------------------------------


def _batches(n: int = TOTAL) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for step in range(1, n + 1):
        x = torch.randn(16, 6, generator=gen) * (1 + step % 3)  # norms that vary, so τ bites
        if step in SKIP_STEPS:
            x = torch.full_like(x, float("nan"))
        out.append((x, torch.randn(16, 2, generator=gen)))
    return out


def _engine(clip) -> AmpTrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return AmpTrainState(model, opt, nn.functional.mse_loss, dtype="bf16", clip=clip, scheduler=sched)


def _manual_swap_run(window: int, every: int, cap: float | None, quantile: float):
    """What ``sweep.session.run_training`` did before the move: NoClip/cap, then swap in GlobalNormClip(τ)."""
    state = _engine(GlobalNormClip(cap) if cap else NoClip())
    windows = _reference_windows(window, every, TOTAL)
    calibrators = {w.start: NormCalibrator(quantile) for w in windows}
    window_of = {s: w for w in windows for s in w}
    records, taus = [], []
    for x, y in _batches():
        log = state.step(x, y)
        records.append(log)
        w = window_of.get(log.step)
        if w is not None:
            calibrators[w.start].add(log)
            if log.step == w[-1]:
                summary = calibrators[w.start].summary()
                taus.append(summary.recommended_max_norm)
                state.clip = GlobalNormClip(summary.recommended_max_norm)
    return state, records, taus


def _rows(records) -> list[str]:
    return [repr(r.row()) for r in records]  # repr: NaN fields compare equal, floats bit for bit


@pytest.mark.parametrize("window, every, cap", [(4, 0, None), (4, 0, 0.3), (3, 4, None), (3, 5, 0.3)])
def test_records_are_bit_identical_to_the_manual_swap(window, every, cap):
    ref_state, ref_records, taus = _manual_swap_run(window, every, cap, quantile=0.5)
    policy = CalibratedClip(window, every, quantile=0.5, cap=cap, total_steps=TOTAL)
    state = _engine(policy)
    records = [state.step(x, y) for x, y in _batches()]
    assert _rows(records) == _rows(ref_records)
    for a, b in zip(state.model.parameters(), ref_state.model.parameters()):
        assert torch.equal(a, b)
    assert [s.recommended_max_norm for s in policy.summaries] == taus and policy.tau == taus[-1]
    assert sum(r.skipped for r in records) == len(SKIP_STEPS)
    # the threshold in force: the cap (or none) until the first window closes, then each window's τ
    first = _reference_windows(window, every, TOTAL)[0]
    assert all(r.max_norm == cap for r in records[: first[-1]])
    assert records[first[-1]].max_norm == taus[0]
    assert any(r.clipped for r in records[first[-1] :])  # τ = p50 of the window acts
    assert [policy.phase(s) for s in range(1, TOTAL + 1)] == [
        "calibrate" if any(s in w for w in _reference_windows(window, every, TOTAL)) else "validate"
        for s in range(1, TOTAL + 1)
    ]


# -- resume from the checkpoint alone ---------------------------------------------------------


#: window 1 = steps 1-3, window 2 = 5-7, 9-11; a kill inside each of the first two windows stays in the fast subset
@pytest.mark.parametrize(
    "kill_after", [pytest.param(k, marks=() if k in (2, 6) else pytest.mark.slow) for k in (1, 2, 3, 5, 6, 9)]
)
def test_resume_from_state_dict_alone_gives_the_uninterrupted_records(kill_after):
    batches = _batches()
    full = _engine(CalibratedClip(3, 4, quantile=0.5, total_steps=TOTAL))
    expected = [full.step(x, y) for x, y in batches]

    first = _engine(CalibratedClip(3, 4, quantile=0.5, total_steps=TOTAL))
    records = [first.step(x, y) for x, y in batches[:kill_after]]
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)  # a real checkpoint: serialised
    buf.seek(0)
    del first
    resumed = _engine(CalibratedClip(3, 4, quantile=0.5, total_steps=TOTAL))
    resumed.load_state_dict(torch.load(buf))  # weights_only: the policy's state is plain values
    records += [resumed.step(x, y) for x, y in batches[kill_after:]]
    assert _rows(records) == _rows(expected)
    assert [s.as_dict() for s in resumed.clip.summaries] == [s.as_dict() for s in full.clip.summaries]


def test_a_window_with_no_finite_norm_raises_with_the_record():
    state = _engine(CalibratedClip(2, total_steps=TOTAL))
    nan = torch.full((16, 6), float("nan"))
    state.step(nan, torch.zeros(16, 2))
    with pytest.raises(CalibrationError, match=r"steps 1-2\) has no finite norm") as err:
        state.step(nan, torch.zeros(16, 2))
    assert err.value.record.step == 2 and err.value.record.skipped


# -- window placement, validation on held-out steps, drift -------------------------------------


def _record(step, lr, norm, tau=None):
    clipped = tau is not None and norm > tau
    return StepLog(
        step=step,
        lr=lr,
        grad_l2_pre_clip=norm,
        grad_l2_post_clip=min(norm, tau) if clipped else norm,
        loss=2.0,
        scaler_scale=1.0,
        clipped=clipped,
        max_norm=tau,
    )


def _drive(policy, norms, lrs):
    """Feed records as AmpTrainState would: each step clipped at the threshold in force before it."""
    phases = []
    for i, (n, lr) in enumerate(zip(norms, lrs), start=1):
        policy.observe(_record(i, lr, float(n), policy.threshold))
        phases.append(policy.phase(i))
    return phases


def _warmup_trace(n=400, seed=0, jump_at=None):
    rng = np.random.default_rng(seed)
    steps = np.arange(1, n + 1)
    lrs = np.minimum(steps / 20, 1.0) * 3e-3
    norms = (1 + 9 * np.exp(-steps / 15)) * rng.lognormal(0, 0.3, n)
    if jump_at:
        norms[jump_at - 1 :] *= 3
    return norms, lrs


def test_auto_start_is_the_placement_rule_and_the_window_is_numpy_quantiles():
    norms, lrs = _warmup_trace()
    policy = CalibratedClip(window=100, start="auto", quantile=None, total_steps=len(norms))
    phases = _drive(policy, norms, lrs)
    trace = list(zip(range(1, len(norms) + 1), lrs.tolist(), norms.tolist()))
    placed = auto_window_start(trace, latest=len(norms) - 200 + 1)
    assert policy.placement == placed and placed.rule == "auto" and placed.start > placed.warmup_end == 21
    s = placed.start
    assert phases[: s - 1] == ["settle"] * (s - 1) and phases[s - 1 : s + 99] == ["calibrate"] * 100
    assert phases[s + 99 :] == ["validate"] * (len(norms) - s - 99)
    window = norms[s - 1 : s + 99]
    summary = policy.summaries[0]
    assert summary.quantile == pytest.approx(0.97)  # aimed at the band's midpoint
    assert policy.tau == pytest.approx(np.quantile(window, summary.quantile))
    after = norms[s + 99 :]
    check = policy.checks()[0]
    assert (check.clipped, check.steps) == (int((after > policy.tau).sum()), len(after))
    assert check.predicted == pytest.approx(np.mean(window > policy.tau))


def test_validate_steps_then_train_and_start_n():
    norms, lrs = _warmup_trace(200)
    policy = CalibratedClip(window=50, start=40, validate=30, total_steps=200)
    phases = _drive(policy, norms, lrs)
    assert phases == ["settle"] * 40 + ["calibrate"] * 50 + ["validate"] * 30 + ["train"] * 80
    assert policy.checks()[0].steps == 30 and policy.placement.rule == "fixed"
    legacy = CalibratedClip(window=50, total_steps=200)  # start=0: the window from step 1, as before
    assert _drive(legacy, norms, lrs)[:51] == ["calibrate"] * 50 + ["validate"]


@pytest.mark.parametrize("validate", [0, 30, 150])
def test_back_to_back_windows_validate_each_tau_on_the_next_window(validate):
    """every == window leaves no step between windows, but τ_k clips every step of window k + 1:
    those are its held-out steps. Counted against numpy on the same trace (at most ``validate``)."""
    norms, lrs = _warmup_trace(400, seed=3)
    policy = CalibratedClip(window=100, every=100, start=60, validate=validate, quantile=0.9, total_steps=400)
    _drive(policy, norms, lrs)
    ends = [s.end_step for s in policy.summaries]
    assert ends == [160, 260, 360, 400]
    for k, (summary, (clipped, taken)) in enumerate(zip(policy.summaries, policy.validation)):
        held_out = norms[summary.end_step : (ends[k + 1] if k + 1 < len(ends) else len(norms))]
        if validate:
            held_out = held_out[:validate]
        assert (clipped, taken) == (int((held_out > summary.recommended_max_norm).sum()), len(held_out))
    assert all(c is not None for c in policy.checks()[:3]) and policy.checks()[3] is None


def test_drift_is_flagged_only_when_the_tau_intervals_separate():
    """Over 10 seeds: a stationary trace rarely separates two 95% intervals; a ×3 jump always does."""
    false_alarms, caught = 0, 0
    for seed in range(10):
        norms, lrs = _warmup_trace(600, seed=seed)
        steady = CalibratedClip(window=100, every=150, start=60, quantile=0.9, total_steps=600)
        _drive(steady, norms, lrs)
        assert len(steady.summaries) == 4
        false_alarms += sum(steady.drift())
        norms, lrs = _warmup_trace(600, seed=seed, jump_at=300)  # windows 61-160, 211-310, 361-460, 511-600
        moved = CalibratedClip(window=100, every=150, start=60, quantile=0.9, total_steps=600)
        _drive(moved, norms, lrs)
        caught += moved.drift()[2]
        assert moved.checks()[1].realised > moved.checks()[1].predicted  # the window before the jump under-predicts
    assert false_alarms <= 2  # of 30 window pairs
    assert caught == 10


#: settle, calibrate, validate, train; a kill while calibrating stays in the fast subset
@pytest.mark.parametrize(
    "kill_after", [pytest.param(k, marks=() if k == 45 else pytest.mark.slow) for k in (15, 45, 58, 66)]
)
def test_auto_start_and_validation_resume_from_the_state_dict_alone(kill_after):
    total = 70
    gen = torch.Generator().manual_seed(5)
    batches = [(torch.randn(16, 6, generator=gen), torch.randn(16, 2, generator=gen)) for _ in range(total)]

    def policy():
        return CalibratedClip(10, start="auto", validate=10, quantile=0.5, total_steps=total)

    full = _engine(policy())
    expected = [full.step(x, y) for x, y in batches]
    assert full.clip.placement is not None and full.clip.summaries
    first = _engine(policy())
    records = [first.step(x, y) for x, y in batches[:kill_after]]
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = _engine(policy())
    resumed.load_state_dict(torch.load(buf))
    records += [resumed.step(x, y) for x, y in batches[kill_after:]]
    assert _rows(records) == _rows(expected)
    assert resumed.clip.placement == full.clip.placement
    assert [c.as_dict() for c in resumed.clip.checks()] == [c.as_dict() for c in full.clip.checks()]
    assert [resumed.clip.phase(s) for s in range(1, total + 1)] == [full.clip.phase(s) for s in range(1, total + 1)]


@pytest.mark.parametrize(
    "options, match",
    [
        ({"start": "later"}, "start='later'"),
        ({"start": -1}, "start=-1"),
        ({"validate": -2}, "validate=-2"),
        ({"target_clip": [0.05, 0.01]}, "target_clip"),
    ],
)
def test_bad_calibration_options_name_the_value(options, match):
    with pytest.raises(ValueError, match=match):
        make_clip_policy("calibrated", **options)


def test_auto_in_a_run_too_short_to_wait_starts_at_step_1_and_says_why():
    p = CalibratedClip(window=20, start="auto", total_steps=40)
    assert p.placement.start == 1 and p.placement.rule == "deadline" and "no room to wait" in p.placement.reason
    assert p.phase(1) == "calibrate"
    roomy = CalibratedClip(window=20, start="auto", total_steps=100)
    assert roomy.placement is None and roomy.detector.latest == 100 - 20 - 20 + 1


@pytest.mark.parametrize(
    ("options", "steps", "fix"),
    [
        ({"validate": 0, "every": 0}, 60, f"train longer after the window ({LOOP})"),  # the run ended
        ({"validate": 10, "every": 0}, 1000, "raise validate=N"),  # validate held them to 10, steps remain
        # validate held them to 10, but the run ends 30 steps after the window: validate alone cannot reach ≈600
        ({"validate": 10, "every": 0}, 60, f"{LOOP}, and raise validate=N (the run ends 30 steps after"),
        ({"validate": 10, "every": 0}, 40, f"{LOOP}, and raise validate=N (the run ends 10 steps after"),
        # the run ended them at 15; more steps alone stop at validate=20, far short of ≈600
        ({"validate": 20, "every": 0}, 45, f"train longer after the window ({LOOP}, and raise validate=N)"),
        ({"validate": 0, "every": 40}, 80, "space the windows further apart (every=N)"),  # the next window
    ],
)
def test_too_few_held_out_steps_name_what_ended_them(options, steps, fix):
    """Raising calibrate.validate adds no step where the run or the next window ended the validation, and
    raising steps none beyond calibrate.validate: the advice names every knob that binds."""
    norms = np.r_[np.random.default_rng(0).lognormal(0, 0.3, 30), np.full(steps - 30, 0.5)]  # none clips after
    policy = CalibratedClip(window=30, start=0, quantile=0.97, total_steps=steps, **options)
    _drive(policy, norms, np.full(steps, 1e-3))
    check = policy.checks()[0]
    assert not check.inside and check.consistent  # too few steps to tell
    assert f"too few validation steps to tell the ratio from the band ({check.steps}): {fix}" in check.action
    assert "; ≈" in check.action.split(fix, 1)[1]


def test_next_action_names_later_windows_only_where_the_run_has_one():
    """``every`` beyond the run's end opens no second window: the first window's next action must not send
    the user to "the later windows" (there are none) but to ``calibrate.every``, as a one-window run's does;
    in a run that does repeat, every window but the last has a later one."""
    norms, lrs = _warmup_trace(400, seed=3, jump_at=200)  # the norms rise after the window: drift up
    once = CalibratedClip(window=100, every=1000, start=60, quantile=0.9, total_steps=400)
    _drive(once, norms, lrs)
    assert len(once.summaries) == 1 and once.checks()[0].realised > once.checks()[0].predicted
    single = CalibratedClip(window=100, start=60, quantile=0.9, total_steps=400)
    _drive(single, norms, lrs)
    assert once.checks()[0].action == single.checks()[0].action
    assert "later windows" not in once.checks()[0].action and "every=" in once.checks()[0].action
    repeated = CalibratedClip(window=100, every=150, start=60, quantile=0.9, total_steps=330)
    _drive(repeated, norms[:330], lrs[:330])  # windows 61-160 and 211-310, then no room for a third
    first, last = repeated.checks()
    assert "later windows" in first.action and "later windows" not in last.action
