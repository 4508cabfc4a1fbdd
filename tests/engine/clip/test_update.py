"""Update clipping vs gradient clipping for Adam (the seed's example), and weight decay."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from clipamp_engine.clip import GlobalNormClip, make_clip_policy
from clipamp_engine.norms import clip_global_l2_norm, total_norm

from .helpers import _clip

# -- Adam update vs gradient clipping (the seed's example) ---------------------------------------


def _adam_at_the_seed_example():
    """Adam whose preconditioned update for g=(1,1) is u=(1, 100) (√v̂+ε = (1, 0.01)):
    β1=0 (m̂ = g), β2=0.9999 with v=(1, 0) before the step, a step count so large that bias
    correction is 1: then v̂ = (0.9999·1 + 1e-4, 1e-4) = (1, 1e-4)."""
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=1.0, betas=(0.0, 0.9999), eps=1e-8)
    opt.state[p] = {"step": torch.tensor(1e6), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.tensor([1.0, 0.0])}
    p.grad = torch.tensor([1.0, 1.0])
    return p, opt


def test_adam_update_is_100_while_grad_norm_is_sqrt2():
    p, opt = _adam_at_the_seed_example()
    assert total_norm([p.grad]).item() == pytest.approx(math.sqrt(2))
    opt.step()
    torch.testing.assert_close(-p.detach(), torch.tensor([1.0, 100.0]), rtol=1e-4, atol=0)
    assert p.norm().item() == pytest.approx(100.005, rel=1e-4)


def test_grad_clipping_does_not_bound_the_adam_update_but_update_clipping_does():
    # gradient clipping at τ=1: the raw gradient shrinks, the Adam update stays ≈ 100
    p, opt = _adam_at_the_seed_example()
    _clip(GlobalNormClip(1.0), [p])
    opt.step()
    assert p.norm().item() > 99.0

    # update clipping at ρ=1: ‖Δθ‖ = 1, the direction of the Adam update kept
    p, opt = _adam_at_the_seed_example()
    policy = make_clip_policy("update", max_update_norm=1.0)
    pre, post = _clip(policy, [p])
    assert torch.equal(pre, post) and torch.equal(p.grad, torch.ones(2))  # gradients untouched
    policy.before_step([p], opt)
    opt.step()
    extra = policy.after_step([p], opt)
    assert extra["update_l2_pre_clip"].item() == pytest.approx(100.005, rel=1e-4)
    assert p.norm().item() == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(p.detach() / p.norm(), -torch.tensor([1.0, 100.0]) / math.hypot(1, 100))


def test_update_clipping_leaves_decoupled_weight_decay_alone():
    torch.manual_seed(0)
    theta = torch.randn(10) * 3
    g = torch.randn(10)
    lr, wd, rho = 0.1, 0.5, 0.01

    ref = nn.Parameter(theta.clone())
    ref.grad = g.clone()
    torch.optim.AdamW([ref], lr=lr, weight_decay=wd).step()
    decayed = theta * (1 - lr * wd)
    u = ref.detach() - decayed  # AdamW's data update, weight decay excluded

    p = nn.Parameter(theta.clone())
    p.grad = g.clone()
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd)
    policy = make_clip_policy("update", max_update_norm=rho)
    policy.before_step([p], opt)
    opt.step()
    policy.after_step([p], opt)
    expected = decayed + u * rho / (u.norm() + 1e-6)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)
    # the weight-decay part is intact: what remains after removing the decay is the clipped update
    assert (p.detach() - decayed).norm().item() == pytest.approx(rho, rel=1e-4)
    # decay alone moved θ by lr·wd·‖θ‖ ≫ ρ: it was not clipped
    assert (theta - decayed).norm().item() > 10 * rho


def test_coupled_l2_in_the_loss_is_part_of_the_clipped_gradient_norm():
    """Coupled L2 (λ/2‖θ‖² in the loss) enters ``.grad`` as λθ, so the clipped norm includes it.

    Note what torch's ``Adam(weight_decay=λ)`` does instead: it adds λθ to the gradient
    *inside* ``step()``, after clipping, so with torch optimizers that L2 term escapes
    gradient clipping (while ``update`` mode, which measures the resulting step, does
    include it — see the next test).
    """
    theta = torch.tensor([3.0, 4.0])
    lam = 2.0
    p = nn.Parameter(theta.clone())
    loss = (p * torch.tensor([0.0, 0.0])).sum() + lam / 2 * p.pow(2).sum()  # data gradient 0: only L2
    loss.backward()
    torch.testing.assert_close(p.grad, lam * theta)
    pre, post = clip_global_l2_norm([p], max_norm=1.0)
    assert pre.item() == pytest.approx(lam * 5.0)
    assert p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)  # the L2 term itself got clipped


def test_update_clipping_includes_coupled_adam_weight_decay():
    theta, lr, wd, rho = torch.tensor([3.0, 4.0]), 0.1, 0.5, 1e-3
    p = nn.Parameter(theta.clone())
    p.grad = torch.zeros(2)  # all of the step comes from the coupled L2 term
    opt = torch.optim.Adam([p], lr=lr, weight_decay=wd)
    policy = make_clip_policy("update", max_update_norm=rho)
    policy.before_step([p], opt)
    opt.step()
    policy.after_step([p], opt)
    assert (p.detach() - theta).norm().item() == pytest.approx(rho, rel=1e-3)
