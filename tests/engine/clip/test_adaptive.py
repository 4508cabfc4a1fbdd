"""Online thresholds: AutoClip (quantile) and ZClip (z-score) against their reference algorithms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from clipamp_engine.clip import QuantileClip, ZScoreClip

from .helpers import _clip, _params_with_grads

# -- AutoClip ---------------------------------------------------------------------------------


def test_quantile_clips_at_the_percentile_of_the_history_including_the_current_norm():
    norms = [5.0, 1.0, 2.0, 8.0, 3.0, 0.5, 9.0, 4.0]
    policy = QuantileClip(quantile=0.25, history=5)
    history: list[float] = []
    for step, n in enumerate(norms, 1):
        history.append(n)
        tau = float(np.percentile(history[-5:], 25))
        (p,) = _params_with_grads(torch.tensor([n, 0.0]))
        pre, post = _clip(policy, [p], step)
        expected = n if n <= tau else tau * n / (n + 1e-6)
        assert post.item() == pytest.approx(expected, rel=1e-5), step
        assert policy.threshold == pytest.approx(tau, rel=1e-6)
    # first step unclipped (τ_1 = ‖g_1‖)
    first = QuantileClip()
    (p,) = _params_with_grads(torch.tensor([3.0, 4.0]))
    pre, post = _clip(first, [p])
    assert torch.equal(post, pre) and torch.equal(p.grad, torch.tensor([3.0, 4.0]))


def test_quantile_state_round_trip_continues_identically():
    gen = torch.Generator().manual_seed(1)
    norms = (torch.rand(30, generator=gen) * 10).tolist()
    a = QuantileClip(quantile=0.5, history=8)
    for s, n in enumerate(norms[:20], 1):
        _clip(a, _params_with_grads(torch.tensor([n])), s)
    b = QuantileClip(quantile=0.5, history=8)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.norms(), b.norms())
    for s, n in enumerate(norms[20:], 21):
        _, pa = _clip(a, _params_with_grads(torch.tensor([n])), s)
        _, pb = _clip(b, _params_with_grads(torch.tensor([n])), s)
        assert torch.equal(pa, pb)


# -- ZClip ------------------------------------------------------------------------------------


def _zclip_at(mean: float, std: float, **kw) -> ZScoreClip:
    z = ZScoreClip(**kw)
    z.load_state_dict({"mean": mean, "var": std * std, "warmup_norms": []})
    return z


def test_zclip_fixture_mean_1_std_half_norm_3():
    """The issue's fixture "μ=1, σ=0.5, norm 3 → threshold 1.5" holds for the paper's reciprocal
    rule τ = μ + (z_thresh²/z)·σ with z_thresh = 2: z = (3−1)/0.5 = 4 > 2, τ = 1 + (4/4)·0.5.
    With the default z_thresh = 2.5 the same rule gives 1 + (6.25/4)·0.5 = 1.78125, and the
    "mean" option clips to μ = 1."""
    for z_thresh, expected in [(2.0, 1.5), (2.5, 1.78125)]:
        policy = _zclip_at(1.0, 0.5, z_thresh=z_thresh, eps=0.0)
        (p,) = _params_with_grads(torch.tensor([3.0, 0.0]))
        pre, post = _clip(policy, [p], step=100)
        assert policy.threshold == pytest.approx(expected, rel=1e-6)
        assert post.item() == pytest.approx(expected * 3 / (3 + 1e-6), rel=1e-6)
        # the EMA is fed the clipped norm τ, not 3
        mean = 0.97 * 1.0 + 0.03 * expected
        assert policy.mean.item() == pytest.approx(mean, rel=1e-6)
        assert policy.var.item() == pytest.approx(0.97 * 0.25 + 0.03 * (expected - mean) ** 2, rel=1e-6)
    policy = _zclip_at(1.0, 0.5, clip_option="mean", eps=0.0)
    (p,) = _params_with_grads(torch.tensor([3.0, 0.0]))
    _, post = _clip(policy, [p], step=100)
    assert post.item() == pytest.approx(1.0, rel=1e-5)


def _zclip_reference(norms, alpha=0.97, z_thresh=2.5, warmup=25, eps=1e-6):
    """The released ZClip algorithm (mode="zscore", adaptive_scaling, clip_factor 1), in floats."""
    buf, mean, var, out = [], None, None, []
    for g in norms:
        if mean is None:
            buf.append(g)
            if len(buf) == warmup:
                mean = sum(buf) / len(buf)
                var = sum((x - mean) ** 2 for x in buf) / len(buf)
            out.append(g)
            continue
        std = var**0.5
        z = (g - mean) / (std + eps)
        clip_val = mean + (z_thresh * std) / (z / z_thresh) if z > z_thresh else None
        post = g if clip_val is None or g <= clip_val else clip_val * g / (g + 1e-6)
        out.append(post)
        fed = clip_val if clip_val is not None else g
        mean = alpha * mean + (1 - alpha) * fed
        var = alpha * var + (1 - alpha) * (fed - mean) ** 2
    return out


def test_zclip_matches_the_released_algorithm_with_warmup():
    gen = torch.Generator().manual_seed(0)
    norms = (1.0 + 0.1 * torch.randn(80, generator=gen, dtype=torch.float64)).abs().tolist()
    for i in (10, 30, 31, 50, 70):  # spikes: one inside warm-up (never clipped), the rest after it
        norms[i] *= 8
    policy = ZScoreClip()
    got = []
    for s, n in enumerate(norms, 1):
        (p,) = _params_with_grads(torch.tensor([n], dtype=torch.float32))
        got.append(_clip(policy, [p], s)[1].item())
        if s <= 25:
            assert got[-1] == pytest.approx(n, rel=1e-6)  # no clipping during warm-up
    ref = _zclip_reference([float(torch.tensor(n, dtype=torch.float32)) for n in norms])
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert got[30] < norms[30] / 2 and got[50] < norms[50] / 2  # post-warm-up spikes clipped


def test_zclip_state_round_trip():
    a = ZScoreClip(warmup_steps=5)
    for s, n in enumerate([1.0, 1.1, 0.9, 1.0], 1):
        _clip(a, _params_with_grads(torch.tensor([n])), s)
    b = ZScoreClip(warmup_steps=5)
    b.load_state_dict(a.state_dict())  # mid warm-up
    for s, n in enumerate([1.2, 1.0, 5.0, 0.8], 5):
        _, pa = _clip(a, _params_with_grads(torch.tensor([n])), s)
        _, pb = _clip(b, _params_with_grads(torch.tensor([n])), s)
        assert torch.equal(pa, pb)
    c = ZScoreClip(warmup_steps=5)
    c.load_state_dict(a.state_dict())  # after warm-up
    assert torch.equal(c.mean, a.mean) and torch.equal(c.var, a.var)
