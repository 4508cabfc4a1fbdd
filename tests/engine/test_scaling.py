"""Loss-scale control: DeepSpeed hysteresis, floor, cap, alarm, checkpoints, AmpTrainState."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from clipamp_engine import AmpTrainState
from clipamp_engine.scaling import HysteresisScaler, LossScaleFloorWarning, LossScaler


def _iteration(scaler: HysteresisScaler, overflow: bool) -> float:
    """One real GradScaler iteration (scale → backward → unscale_ → step → update); returns the new scale."""
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    loss = (p * (float("inf") if overflow else 1.0)).sum()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return scaler.get_scale()


def test_hysteresis_3_four_overflows_gives_256_256_128_64():
    """DeepSpeed's rule with init_scale 256, factor 2 (backoff 0.5), hysteresis 3: overflow 1 spends
    the counter 3→2 (scale 256), overflow 2 spends 2→1 (256), overflow 3 finds the counter at 1 and
    backs off to 128, overflow 4 (counter still 1) backs off to 64. These are the scales *after*
    each overflow's update."""
    scaler = HysteresisScaler("cpu", init_scale=256.0, hysteresis=3)
    assert [_iteration(scaler, True) for _ in range(4)] == [256.0, 256.0, 128.0, 64.0]
    assert scaler.hysteresis_left == 1 and scaler.overflows == 4 and scaler.backoffs == 2


def test_hysteresis_is_restored_only_on_growth_unless_consecutive():
    plain = HysteresisScaler("cpu", init_scale=256.0, hysteresis=2, growth_interval=3)
    assert _iteration(plain, True) == 256.0  # absorbed, counter 2→1
    _iteration(plain, False)  # clean step: counter stays 1 (not consecutive)
    assert plain.hysteresis_left == 1
    assert _iteration(plain, True) == 128.0  # so this overflow backs off at once

    consecutive = HysteresisScaler("cpu", init_scale=256.0, hysteresis=2, consecutive_hysteresis=True)
    assert _iteration(consecutive, True) == 256.0
    _iteration(consecutive, False)  # clean step restores the counter to 2
    assert consecutive.hysteresis_left == 2
    assert _iteration(consecutive, True) == 256.0  # absorbed again


def test_growth_restores_hysteresis_and_respects_the_cap():
    scaler = HysteresisScaler("cpu", init_scale=256.0, hysteresis=2, growth_interval=2, max_scale=512.0)
    _iteration(scaler, True)
    assert scaler.hysteresis_left == 1
    assert [_iteration(scaler, False) for _ in range(6)] == [256.0, 512.0, 512.0, 512.0, 512.0, 512.0]
    assert scaler.hysteresis_left == 2


def test_floor_is_a_warning_and_a_flag():
    scaler = HysteresisScaler("cpu", init_scale=4.0, hysteresis=1, min_scale=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _iteration(scaler, True) == 2.0
        assert not scaler.at_floor
    with pytest.warns(LossScaleFloorWarning, match="floor min_scale=1"):
        assert _iteration(scaler, True) == 1.0
    assert scaler.at_floor
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per arrival, not on every overflow at the floor
        assert _iteration(scaler, True) == 1.0


def test_back_off_applies_the_same_rule_before_backward():
    scaler = HysteresisScaler("cpu", init_scale=256.0, hysteresis=2)
    scaler.back_off()  # before any scale(): lazily initialised scale
    assert scaler.get_scale() == 256.0 and scaler.hysteresis_left == 1
    scaler.back_off()
    assert scaler.get_scale() == 128.0
    assert _iteration(scaler, False) == 128.0


def test_state_dict_round_trip_keeps_every_counter():
    a = HysteresisScaler("cpu", init_scale=256.0, hysteresis=3, growth_interval=4, min_scale=2.0)
    for overflow in (True, False, True, True, False):
        _iteration(a, overflow)
    b = HysteresisScaler("cpu", init_scale=1024.0)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    for overflow in (True, False, False, True, True, True, True):
        assert _iteration(a, overflow) == _iteration(b, overflow)
        assert (a.hysteresis_left, a.at_floor, a.overflows) == (b.hysteresis_left, b.at_floor, b.overflows)


def test_disabled_is_a_no_op():
    scaler = HysteresisScaler("cpu", enabled=False)
    scaler.back_off()
    scaler.update()
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


def test_invalid_settings_are_value_errors():
    with pytest.raises(ValueError, match="hysteresis=0"):
        HysteresisScaler("cpu", hysteresis=0)
    with pytest.raises(ValueError, match="min_scale <= init_scale <= max_scale"):
        HysteresisScaler("cpu", init_scale=2.0**30, max_scale=2.0**24)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"init_scale": 0}, r"^init_scale=0 must be a number > 0 that fits in fp32"),
        ({"init_scale": float("inf")}, r"^init_scale=inf must be a number > 0"),
        ({"init_scale": float("nan")}, r"^init_scale=nan must be a number > 0"),
        ({"growth_interval": 0}, r"^growth_interval=0 must be an integer >= 1"),
        ({"growth_factor": 0.5}, r"^growth_factor=0.5 must be a finite number > 1"),
        ({"backoff_factor": 2.0}, r"^backoff_factor=2.0 must be in \(0, 1\)"),
    ],
)
@pytest.mark.parametrize("cls", [LossScaler, HysteresisScaler])
def test_a_loss_scaler_that_could_not_train_is_refused(cls, setting, message):
    """``LossScaler('cpu', init_scale=0)`` (or inf, NaN) skipped every fp16 step with the scale stuck, and
    ``growth_interval=0`` never grew the scale, silently; torch asserts only the two factors."""
    with pytest.raises(ValueError, match=message):
        cls("cpu", **setting)
    if cls is LossScaler:  # disabled (bf16/fp32): a no-op, as GradScaler (HysteresisScaler checks its range anyway)
        cls("cpu", enabled=False, **setting)


def test_plugs_into_amp_train_state_fp16():
    """fp16 on CPU with an absurd initial scale: gradients overflow until the scale comes down.
    With hysteresis 2 the first overflow is absorbed (scale kept), later ones halve it, and
    every overflow is a skipped step; then steps are taken at the scale that fits."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = HysteresisScaler("cpu", init_scale=2.0**24, hysteresis=2, growth_interval=1000, max_scale=2.0**24)
    assert isinstance(scaler, LossScaler)
    state = AmpTrainState(
        model, opt, lambda out, y: (out.float() - y).pow(2).mean() * 100.0, dtype="fp16", scaler=scaler
    )
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    records = [state.step(x, y) for _ in range(24)]
    scales = [r.scaler_scale for r in records]
    skipped = [r.skipped for r in records]
    assert skipped[0] and skipped[1] and not skipped[-1]
    assert scales[0] == scales[1] == 2.0**24  # first overflow absorbed by hysteresis
    assert scales[2] == 2.0**23  # second overflow halves it
    first_taken = skipped.index(False)
    assert all(skipped[:first_taken]) and not any(skipped[first_taken:])
    assert all(r.skip_reason == "nonfinite_grad" for r in records[:first_taken])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert state.state_dict()["scaler"]["overflows"] == first_taken


def test_a_grad_scaler_given_as_the_scaler_names_the_loss_scaler_and_how_to_carry_its_scale():
    """A loop adopting the engine passes the ``GradScaler`` it had: refused, the message naming the
    ``LossScaler`` to build and how to carry the scale it reached; following it, the run goes on at that scale."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    grad_scaler.load_state_dict({**grad_scaler.state_dict(), "scale": 512.0, "_growth_tracker": 7})
    with pytest.raises(ValueError) as refused:
        AmpTrainState(model, opt, torch.nn.functional.mse_loss, dtype="fp16", scaler=grad_scaler)
    assert str(refused.value) == (
        "scaler=GradScaler must be a clipamp_engine.LossScaler (a GradScaler that can back off on refused losses), "
        "e.g. LossScaler('cpu', init_scale=2.0**16, growth_interval=2000); to carry this GradScaler's scale, load "
        "its state: LossScaler(device, ...).load_state_dict(grad_scaler.state_dict())"
    )
    scaler = LossScaler("cpu")
    scaler.load_state_dict(grad_scaler.state_dict())
    state = AmpTrainState(model, opt, torch.nn.functional.mse_loss, dtype="fp16", scaler=scaler)
    log = state.step(torch.randn(8, 4), torch.randn(8, 1))
    assert log.scaler_scale == 512.0 and scaler.state_dict()["_growth_tracker"] == 8
