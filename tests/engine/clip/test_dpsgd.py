"""DP-SGD: per-sample clipping against the issue's fixture and a per-example loop reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clipamp_engine.clip.dpsgd import dp_sgd_grads


def _linear_loss(out, y):
    return out.sum()  # loss = w·x: the per-example gradient is x itself


def test_fixture_per_sample_3_4_and_03_04_clip_to_09_12():
    """Per-example gradients [3,4] (norm 5) and [0.3,0.4] (norm 0.5), C=1: the first is scaled to
    [0.6,0.8], the second is kept; their sum is [0.9,1.2] and ``.grad`` holds it divided by B=2."""
    model = nn.Linear(2, 1, bias=False)
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    stats = dp_sgd_grads(model, _linear_loss, x, torch.zeros(2), max_norm=1.0, noise_multiplier=0.0)
    torch.testing.assert_close(model.weight.grad * 2, torch.tensor([[0.9, 1.2]]), rtol=1e-5, atol=1e-6)
    assert stats["batch_size"] == 2
    assert stats["clip_fraction"] == 0.5
    assert stats["mean_sample_norm"] == pytest.approx(2.75)
    assert stats["max_sample_norm"] == pytest.approx(5.0)
    assert stats["noise_std"] == 0.0


def _loop_reference(model, loss_fn, x, y, c, per_layer):
    sums = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(x)):
        model.zero_grad()
        loss_fn(model(x[i : i + 1]), y[i : i + 1]).backward()
        gs = [p.grad.clone() for p in model.parameters()]
        if per_layer:
            gs = [g * min(1.0, c / (g.norm().item() + 1e-6)) for g in gs]
        else:
            n = torch.cat([g.flatten() for g in gs]).norm().item()
            gs = [g * min(1.0, c / (n + 1e-6)) for g in gs]
        sums = [s + g for s, g in zip(sums, gs)]
    return [s / len(x) for s in sums]


@pytest.mark.parametrize("per_layer", [False, True])
def test_matches_a_per_example_backward_loop(per_layer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(12, 5) * 3, torch.randint(0, 3, (12,))
    ref = _loop_reference(model, nn.functional.cross_entropy, x, y, 0.5, per_layer)
    dp_sgd_grads(model, nn.functional.cross_entropy, x, y, max_norm=0.5, noise_multiplier=0.0, per_layer=per_layer)
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=1e-4, atol=1e-6)


class _ComplexLinear(nn.Module):
    """A complex weight with a real output: its per-example norm is √Σ|z|², the imaginary parts included."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 4, dtype=torch.cfloat))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head((x.to(torch.cfloat) @ self.w).abs())


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("kind", ["complex", "fp64"])
def test_complex_and_fp64_models_match_the_per_example_loop(kind, per_layer):
    """Before: ``.float()`` dropped a complex gradient's imaginary part (an example of norm 31.6 was clipped to
    2.56, not 1) and normed an fp64 model's gradients in fp32."""
    torch.manual_seed(0)
    model = _ComplexLinear() if kind == "complex" else nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    model = model.double() if kind == "fp64" else model
    x, y = torch.randn(12, 5, dtype=torch.float64 if kind == "fp64" else torch.float32) * 3, torch.randint(0, 3, (12,))
    ref = _loop_reference(model, nn.functional.cross_entropy, x, y, 0.5, per_layer)
    dp_sgd_grads(model, nn.functional.cross_entropy, x, y, max_norm=0.5, noise_multiplier=0.0, per_layer=per_layer)
    tol = {"rtol": 1e-12, "atol": 1e-14} if kind == "fp64" else {"rtol": 1e-4, "atol": 1e-6}
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.grad, r, **tol)


def test_noise_has_std_sigma_c_over_b_and_is_reproducible():
    model = nn.Linear(2000, 1, bias=False)
    x = torch.zeros(4, 2000)  # zero gradients: .grad is pure noise / B
    kw = dict(max_norm=2.0, noise_multiplier=1.5)
    dp_sgd_grads(model, _linear_loss, x, torch.zeros(4), generator=torch.Generator().manual_seed(0), **kw)
    first = model.weight.grad.clone()
    assert first.std().item() == pytest.approx(1.5 * 2.0 / 4, rel=0.05)
    dp_sgd_grads(model, _linear_loss, x, torch.zeros(4), generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(model.weight.grad, first)


def test_per_layer_bounds_and_total_sensitivity():
    model = nn.Linear(2, 1)  # weight and bias: two "layers"
    x = torch.tensor([[3.0, 4.0]])
    stats = dp_sgd_grads(
        model,
        _linear_loss,
        x,
        torch.zeros(1),
        max_norm=[1.0, 0.5],
        noise_multiplier=1.0,
        per_layer=True,
        generator=torch.Generator().manual_seed(0),
    )
    assert stats["noise_std"] == pytest.approx((1.0**2 + 0.5**2) ** 0.5)
    with pytest.raises(ValueError, match="2 trainable parameter tensors"):
        dp_sgd_grads(model, _linear_loss, x, torch.zeros(1), max_norm=[1.0], noise_multiplier=0.0, per_layer=True)
    with pytest.raises(ValueError, match="noise_multiplier"):
        dp_sgd_grads(model, _linear_loss, x, torch.zeros(1), max_norm=1.0, noise_multiplier=-1.0)


# -- the declared gradient source, through AmpTrainState --------------------------------------------


def test_amp_train_state_takes_dpsgd_gradients_from_its_declared_source():
    """The step runs the policy's ``gradient_source`` instead of ``loss.backward()``: the update is
    SGD on ``dp_sgd_grads``' gradients (no noise), equal to the per-example loop's mean."""
    from clipamp_engine import AmpTrainState, make_clip_policy
    from clipamp_engine.clip.dpsgd import PerExampleGradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(12, 5) * 3, torch.randint(0, 3, (12,))
    grads = _loop_reference(model, nn.functional.cross_entropy, x, y, 0.5, per_layer=False)
    clip = make_clip_policy("dpsgd", max_norm=0.5, noise_multiplier=0.0)
    assert isinstance(clip.gradient_source, PerExampleGradients) and not clip.gradient_source.builds_graph
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy, clip=clip)
    assert state.gradients is clip.gradient_source and state.pipeline == "default"
    log = state.step(x, y)
    assert not log.skipped and 0 < log.extra["dp_clip_fraction"] <= 1
    for p, r, g in zip(model.parameters(), ref, grads):
        torch.testing.assert_close(p.detach(), r - 0.1 * g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        (
            {"dtype": "fp16"},
            "clip mode 'dpsgd' computes per-example gradients: it needs accumulation_steps=1 and "
            "dtype bf16 or fp32 (got 1, 'fp16')",
        ),
        ({"accumulation_steps": 2}, "(got 2, 'bf16')"),
    ],
)
def test_the_gradient_source_refuses_fp16_and_accumulation_in_one_line(kw, msg):
    from clipamp_engine import AmpTrainState, make_clip_policy

    model = nn.Linear(3, 1)
    with pytest.raises(ValueError) as err:
        AmpTrainState(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.functional.mse_loss,
            clip=make_clip_policy("dpsgd"),
            **kw,
        )
    assert msg in str(err.value) and "\n" not in str(err.value)
