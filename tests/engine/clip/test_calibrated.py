"""CalibratedClip: the app's calibration windows inside the engine, bit for bit, resumable from its state."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from clipamp_engine import AmpTrainState
from clipamp_engine.calibration import CalibrationError, CalibrationWindows, NormCalibrator
from clipamp_engine.clip import CalibratedClip, GlobalNormClip, NoClip, clip_mode_options, make_clip_policy

TOTAL = 13
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


@pytest.mark.parametrize("options, match", [({"window": 1}, "window=1"), ({"window": 4, "every": 3}, "every=3"),
                                            ({"cap": 0}, "cap=0"), ({"quantile": 1.0}, "quantile=1.0"),
                                            ({"every": -1}, "every=-1")])
def test_bad_options_name_the_value(options, match):
    with pytest.raises(ValueError, match=match):
        make_clip_policy("calibrated", **options)


def test_registered_with_plain_options_and_total_steps_as_context():
    assert clip_mode_options("calibrated") == {"window": 100, "every": 0, "quantile": 0.95,
                                               "candidates": [0.5, 1.0, 2.0, 5.0], "cap": None}
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
    assert any(r.clipped for r in records[first[-1]:])  # τ = p50 of the window acts
    assert [policy.phase(s) for s in range(1, TOTAL + 1)] == [
        "calibrate" if any(s in w for w in _reference_windows(window, every, TOTAL)) else "validate"
        for s in range(1, TOTAL + 1)]


# -- resume from the checkpoint alone ---------------------------------------------------------

@pytest.mark.parametrize("kill_after", [1, 2, 3, 5, 6, 9])  # window 1 = steps 1-3, window 2 = 5-7, 9-11
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
