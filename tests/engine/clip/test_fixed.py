"""Fixed thresholds: value and staged clipping, per-group clipping, the bias clipping introduces."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from clipamp_engine.clip import make_clip_policy
from clipamp_engine.norms import clip_global_l2_norm, total_norm

from .helpers import _clip, _params_with_grads

# -- value / staged ---------------------------------------------------------------------------


def test_value_clip_matches_torch_clip_grad_value():
    torch.manual_seed(0)
    g = [torch.randn(5, 4) * 3, torch.randn(7) * 3]
    ours = _params_with_grads(*g)
    ref = _params_with_grads(*g)
    _, post = _clip(make_clip_policy("value", clip_value=0.5), ours)
    torch.nn.utils.clip_grad_value_(ref, 0.5)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(post, total_norm([p.grad for p in ref]))


def test_staged_threshold_follows_the_step():
    policy = make_clip_policy("staged", stages=[[0, 2.0], [1000, 1.0]])
    for step, tau in [(1, 2.0), (999, 2.0), (1000, 1.0), (5000, 1.0)]:
        ps = _params_with_grads(torch.tensor([30.0, 40.0]))
        pre, post = _clip(policy, ps, step)
        assert policy.threshold == tau
        assert post.item() == pytest.approx(tau, rel=1e-5)
        torch.testing.assert_close(ps[0].grad, torch.tensor([0.6, 0.8]) * tau)


# -- per group --------------------------------------------------------------------------------


def test_per_group_clips_each_group_to_its_own_tau_and_changes_direction():
    a, b, c = _params_with_grads(torch.tensor([3.0, 4.0]), torch.tensor([0.3, 0.4]), torch.tensor([6.0, 8.0]))
    opt = torch.optim.SGD([{"params": [a, c]}, {"params": [b]}], lr=0.1)
    policy = make_clip_policy("per_group", max_norms=[1.0, 0.1], optimizer=opt)
    before = torch.cat([a.grad, b.grad, c.grad])
    pre, post = _clip(policy, [a, b, c])
    g0 = math.hypot(5.0, 10.0)  # group 0 = a and c together
    torch.testing.assert_close(a.grad, torch.tensor([3.0, 4.0]) / g0, rtol=1e-5, atol=0)
    torch.testing.assert_close(c.grad, torch.tensor([6.0, 8.0]) / g0, rtol=1e-5, atol=0)
    torch.testing.assert_close(b.grad, torch.tensor([0.06, 0.08]), rtol=1e-5, atol=0)
    after = torch.cat([a.grad, b.grad, c.grad])
    torch.testing.assert_close(post, after.norm())
    cos = torch.dot(before, after) / (before.norm() * after.norm())
    assert cos < 0.9999  # not a projection: the full gradient's direction changed


def test_per_group_fp64_equals_torch_clip_grad_norm_per_group():
    """An fp64 run's τ_j is not rounded to fp32: each group equals ``clip_grad_norm_(group, τ_j)`` to
    fp64 rounding (an fp32 τ of 0.3 made the coefficients differ from torch's by 4e-8 relative)."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    ours, ref = _params_with_grads(*grads), _params_with_grads(*grads)
    opt = torch.optim.SGD([{"params": ours[:2]}, {"params": ours[2:]}], lr=0.1)
    _clip(make_clip_policy("per_group", max_norms=[0.3, 0.1], optimizer=opt), ours)
    torch.nn.utils.clip_grad_norm_(ref[:2], 0.3)
    torch.nn.utils.clip_grad_norm_(ref[2:], 0.1)
    for a, b in zip(ours, ref):
        assert a.grad.dtype == torch.float64
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-14, atol=0)


def test_per_group_patterns_by_name_and_rest_untouched():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for p in model.parameters():
        p.grad = torch.full_like(p, 10.0)
    policy = make_clip_policy("per_group", patterns={r"^0\.": 1.0}, named_params=model.named_parameters())
    _clip(policy, list(model.parameters()))
    first = torch.cat([model[0].weight.grad.flatten(), model[0].bias.grad])
    assert first.norm().item() == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(model[1].weight.grad, torch.full((2, 2), 10.0))  # no pattern, rest_max_norm=None


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        ({"atn": 0.5}, r"'atn' matches no parameter name \(names look like 0\.weight, 0\.bias, 1\.weight, 1\.bias\)"),
        (
            {"weight": 0.5, r"^0\.weight": 1.0},
            r"selects no parameter: every name it matches is taken by the earlier pattern 'weight'",
        ),
    ],
)
def test_per_group_refuses_a_pattern_that_selects_no_parameter(patterns, message):
    """A typo'd or shadowed pattern's τ would clip nothing: the run clipped exactly as without it, silently."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match=message):
        make_clip_policy("per_group", patterns=patterns, named_params=model)
    # the same patterns with a real match clip what they name, as clip_grad_norm_ does per unit
    ours, ref = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for a, b in zip(ours.parameters(), ref.parameters()):
        a.grad, b.grad = torch.full_like(a, 10.0), torch.full_like(b, 10.0)
    _clip(make_clip_policy("per_group", patterns={"weight": 0.5}, named_params=ours), list(ours.parameters()))
    torch.nn.utils.clip_grad_norm_([ref[0].weight, ref[1].weight], 0.5)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_per_group_needs_one_tau_per_group():
    a, b = _params_with_grads(torch.ones(2), torch.ones(2))
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    with pytest.raises(ValueError, match="3 values but the optimizer has 2 param groups"):
        make_clip_policy("per_group", max_norms=[1.0, 1.0, 1.0], optimizer=opt)


# -- the expected-bias example ------------------------------------------------------------------


def test_clipping_biases_the_gradient_expected_value():
    """g = 10 w.p. 0.1 else 0 has E[g] = 1; clipped at τ=1, E[C(g)] = 0.1·1 + 0.9·0 = 0.1."""
    exact = 0.1 * min(10.0, 1.0) + 0.9 * 0.0
    assert exact == pytest.approx(0.1)
    gen = torch.Generator().manual_seed(0)
    draws = torch.where(torch.rand(4000, generator=gen) < 0.1, 10.0, 0.0)
    p = nn.Parameter(torch.zeros(1))
    clipped = []
    for g in draws:
        p.grad = g.reshape(1).clone()
        clip_global_l2_norm([p], max_norm=1.0)
        clipped.append(p.grad.item())
    clipped = np.array(clipped)
    assert draws.mean().item() == pytest.approx(1.0, abs=0.15)
    frac = (draws > 0).float().mean().item()
    assert clipped.mean() == pytest.approx(frac * 10 / (10 + 1e-6), rel=1e-6)  # = P(g=10) · C(10)
    assert clipped.mean() == pytest.approx(0.1, abs=0.015)  # ≈ 0.1, far from E[g] = 1
