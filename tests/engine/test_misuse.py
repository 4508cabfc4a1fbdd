"""``AmpTrainState`` misuse is a ``ValueError`` naming the argument (not a silent no-op, a skip with a
wrong reason, or an error from deep inside torch)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine import AmpTrainState


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _batch(n: int = 8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)


def test_an_optimizer_over_another_models_parameters_is_refused():
    model, other = _model(0), _model(1)
    with pytest.raises(ValueError, match=r"none of them the model's: every step would update nothing"):
        AmpTrainState(model, torch.optim.SGD(other.parameters(), lr=0.1), F.mse_loss, dtype="fp32")


def test_an_optimizer_with_an_extra_parameter_is_accepted():
    model = _model()
    extra = torch.nn.Parameter(torch.ones(()))
    state = AmpTrainState(model, torch.optim.SGD([*model.parameters(), extra], lr=0.1), F.mse_loss, dtype="fp32")
    assert not state.step(*_batch()).skipped


def test_accumulation_larger_than_the_batch_is_a_value_error():
    model = _model()
    state = AmpTrainState(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, dtype="fp32", accumulation_steps=8
    )
    with pytest.raises(ValueError, match=r"accumulation_steps=8 is larger than the batch \(4 samples\)"):
        state.step(*_batch(4))
    assert not state.step(*_batch(8)).skipped  # exactly one sample per micro-batch is fine


@pytest.mark.parametrize(
    "loss_fn,message",
    [
        (
            lambda out, y: F.mse_loss(out, y, reduction="none"),
            r"loss_fn returned a torch.float32 tensor of shape \(8, 1\), not a floating scalar",
        ),
        (lambda out, y: float(F.mse_loss(out, y)), r"loss_fn returned a float \(.*\), not a tensor"),
        (
            lambda out, y: (F.mse_loss(out, y, reduction="sum"), 0),
            r"loss_fn returned \(loss_sum, 0\): the token count must be > 0",
        ),
        (lambda out, y: (F.mse_loss(out, y), 8, 1), r"loss_fn returned a tuple of 3 items"),
    ],
    ids=["non-scalar", "float", "zero-tokens", "triple"],
)
@pytest.mark.parametrize("fused", [False, True])
def test_a_loss_of_the_wrong_form_is_named(loss_fn, message, fused):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True) if fused else torch.optim.SGD(model.parameters())
    state = AmpTrainState(model, opt, loss_fn, dtype="fp32", fused=fused)
    with pytest.raises(ValueError, match=message):
        state.step(*_batch())


@pytest.mark.parametrize("max_norm", [None, "1.0", math.nan, True])
def test_a_max_norm_that_is_no_number_is_named(max_norm):
    model = _model()
    with pytest.raises(ValueError, match=rf"max_norm={max_norm!r} must be a number > 0".replace("(", r"\(")):
        AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, dtype="fp32", max_norm=max_norm)


def test_checked_steps_equal_an_unchecked_reference():
    """The checks change nothing: two steps equal plain torch (clip_grad_norm_ then SGD)."""
    model, ref = _model(), _model()
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, dtype="fp32", max_norm=0.5)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        x, y = _batch()
        state.step(x, y)
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
