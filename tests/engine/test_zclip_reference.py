"""ZClip against the authors' own ``ZClip`` class, and scale-free (issue 11, item 2).

Reference: the ``zclip`` package (PyPI 1.0.0, bluorion-com/ZClip ``zclip/zclip.py``), run on
the same gradients. Its documented behaviour (``_compute_clip_val``, mode "zscore"): a norm is
clipped only when its z-score ``(g − μ)/(σ + eps)`` exceeds ``z_thresh``, to
``μ + z_thresh·σ / (z/z_thresh)`` ("adaptive_scaling") or to μ ("mean"); otherwise
``clip_val`` is None and the gradient is left alone; the EMA is then fed the clip value or the
norm. Its constructor's ``max_grad_norm`` defaults to 1.0, a fixed ceiling: ``None`` here, as
in ``ZScoreClip``'s default.
"""

import math

import numpy as np
import pytest
import torch
from zclip import ZClip

from clipamp_engine import total_norm
from clipamp_engine.clip import ZScoreClip

DIRECTION = torch.tensor([0.6, 0.0, -0.8], dtype=torch.float64)  # unit vector


def _norm_sequence(n_steps=260, seed=0):
    """A drifting, noisy norm trace with spikes of several sizes after the 25-step warm-up."""
    gen = np.random.default_rng(seed)
    t = np.arange(n_steps)
    norms = np.exp(0.15 * gen.standard_normal(n_steps)) * (1.0 + 0.5 * np.exp(-t / 80))
    for i, factor in [(40, 1.6), (41, 1.3), (70, 4.0), (110, 12.0), (111, 2.0), (150, 1.45), (200, 30.0)]:
        norms[i] *= factor
    return norms.tolist()


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))


def _reference_run(norms, **kw):
    """Post-clip norms and z-scores (before each step's update; nan in warm-up) of the
    reference class, driven exactly as its README says: ``zclip.step(model)`` after backward."""
    model, ref = _Model(), ZClip(mode="zscore", max_grad_norm=None, **kw)
    post, zs = [], []
    for g in norms:
        zs.append((g - ref.mean) / (ref.var**0.5 + ref.eps) if ref.initialized else math.nan)
        model.w.grad = DIRECTION * g
        ref.step(model)
        post.append(float(model.w.grad.norm()))
    return np.array(post), np.array(zs)


def _our_run(norms, **kw):
    policy, post = ZScoreClip(**kw), []
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    for step, g in enumerate(norms, 1):
        p.grad = DIRECTION * g
        grads = [p.grad]
        policy.clip_([p], grads, total_norm(grads), step)
        post.append(float(p.grad.norm()))
    return np.array(post)


def _clipped(norms, post):
    return post < np.asarray(norms) * (1 - 1e-9)


@pytest.mark.parametrize("clip_option", ["adaptive_scaling", "mean"])
def test_matches_the_authors_zclip_at_unit_scale(clip_option):
    norms = _norm_sequence()
    ref_post, z = _reference_run(norms, clip_option=clip_option)
    ours = _our_run(norms, clip_option=clip_option)
    # the sequence exercises every branch: warm-up, spikes, and non-spikes above μ + σ
    assert np.isnan(z[:25]).all() and (z[25:] > 2.5).sum() >= 5 and ((z > 1.0) & (z <= 2.5)).sum() >= 10
    np.testing.assert_array_equal(_clipped(norms, ours), z > 2.5)  # only z > z_thresh is clipped
    np.testing.assert_array_equal(_clipped(norms, ours), _clipped(norms, ref_post))
    np.testing.assert_allclose(ours, ref_post, rtol=1e-5)


@pytest.mark.parametrize("clip_option", ["adaptive_scaling", "mean"])
@pytest.mark.parametrize("scale", [1e-5, 1e3])
def test_decisions_are_scale_free(scale, clip_option):
    """The same sequence times 1e-5 or 1e3: the same steps clipped, by the same ratios, as
    the reference clips at scale 1 (where its absolute eps is negligible)."""
    norms = _norm_sequence()
    ref_post, z = _reference_run(norms, clip_option=clip_option)
    scaled = [g * scale for g in norms]
    ours = _our_run(scaled, clip_option=clip_option)
    np.testing.assert_array_equal(_clipped(scaled, ours), z > 2.5)
    np.testing.assert_allclose(ours / scale, ref_post, rtol=1e-5)


@pytest.mark.parametrize("z", [1.67, 2.4, 2.6, 5.0])
def test_norms_near_1e_minus_5_are_treated_as_the_reference_treats_them_at_scale_1(z):
    """The issue's regime: μ = 1e-5, σ = 5e-7. A step z·σ above μ is left untouched when
    z < 2.5 and clipped to μ + (2.5²/z)·σ when z > 2.5 — what the authors' class does with
    μ = 1, σ = 0.05 (at 1e-5 its absolute eps = 1e-6 > σ would read z = 5 as 1.67)."""
    mean, std, scale = 1.0, 0.05, 1e-5
    model, ref = _Model(), ZClip(mode="zscore", max_grad_norm=None)
    ref.initialized, ref.mean, ref.var = True, mean, std * std
    model.w.grad = DIRECTION * (mean + z * std)
    ref.step(model)
    ref_post = float(model.w.grad.norm())

    policy = ZScoreClip()
    policy.load_state_dict({"mean": mean * scale, "var": (std * scale) ** 2, "warmup_norms": []})
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad = DIRECTION * (mean + z * std) * scale
    before = p.grad.clone()
    post = float(policy.clip_([p], [p.grad], total_norm([p.grad]), 100))
    assert post / scale == pytest.approx(ref_post, rel=1e-5)  # our EMA state is fp32
    if z < 2.5:
        assert torch.equal(p.grad, before)  # not a spike: untouched, bit for bit
        assert policy.threshold == pytest.approx((mean + 2.5 * std) * scale, rel=1e-5)  # where it would clip
    else:
        assert post / scale == pytest.approx(mean + 2.5**2 / z * std, rel=1e-5)
