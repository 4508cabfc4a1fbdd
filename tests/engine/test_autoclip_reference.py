"""AutoClip's two conventions against their references (issue 11, item 5).

References:
    The paper's code, ``autoclip_gradient`` in pseeth/autoclip ``autoclip.py`` (read at
    commit 7de6a2fc): ``grad_history.append(obs_grad_norm)`` *then*
    ``clip_value = np.percentile(grad_history, clip_percentile)`` and
    ``clip_grad_norm_(model.parameters(), clip_value)`` — the current norm is in the history.
    Run below as written (a whole history; ``history`` is set longer than the run).
    The ``autoclip`` package (PyPI 0.2.1), ``autoclip.torch.QuantileClip(...,
    global_threshold=True)``, run as is: the threshold is ``inf`` on the first step, then
    ``torch.quantile`` of the previous ``history_length`` norms; the new norm is appended after
    clipping.
"""

import numpy as np
import pytest
import torch
from autoclip.torch import QuantileClip as PackageQuantileClip

from clipamp_engine import total_norm
from clipamp_engine.clip import QuantileClip


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _norm_sequence(n=120, seed=0):
    rng = np.random.default_rng(seed)
    norms = np.exp(0.3 * rng.standard_normal(n))
    for i, factor in [(15, 6.0), (40, 20.0), (41, 3.0), (90, 50.0)]:
        if i < n:
            norms[i] *= factor
    return norms.tolist()


def _set_grads(model, direction, norm):
    for p, d in zip(model.parameters(), direction):
        p.grad = d * norm


def _unit_direction(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    d = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
    n = float(total_norm(d))
    return [t / n for t in d]


def _ours(norms, **kw):
    model, policy, post = _model(), QuantileClip(**kw), []
    direction = _unit_direction(model)
    for step, n in enumerate(norms, 1):
        _set_grads(model, direction, n)
        params = list(model.parameters())
        grads = [p.grad for p in params]
        post.append(float(policy.clip_(params, grads, total_norm(grads), step)))
        assert post[-1] == pytest.approx(float(total_norm([p.grad for p in params])), rel=1e-5)
    return np.array(post)


def _paper(norms, quantile):
    """``autoclip_gradient`` of the paper's code, verbatim in substance."""
    model, grad_history, post = _model(), [], []
    direction = _unit_direction(model)
    for n in norms:
        _set_grads(model, direction, n)
        obs_grad_norm = sum(float(p.grad.norm(2)) ** 2 for p in model.parameters()) ** 0.5
        grad_history.append(obs_grad_norm)
        clip_value = np.percentile(grad_history, quantile * 100)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_value)
        post.append(float(total_norm([p.grad for p in model.parameters()])))
    return np.array(post)


def _package(norms, quantile, history):
    model, post = _model(), []
    direction = _unit_direction(model)
    clipper = PackageQuantileClip(model.parameters(), quantile=quantile, history_length=history, global_threshold=True)
    for n in norms:
        _set_grads(model, direction, n)
        clipper.step()
        post.append(float(total_norm([p.grad for p in model.parameters()])))
    return np.array(post)


def _clipped(norms, post):
    return post < np.asarray(norms) * (1 - 1e-5)


@pytest.mark.parametrize("quantile", [0.1, 0.5, 0.9, 1.0])
def test_default_is_the_papers_rule(quantile):
    norms = _norm_sequence()
    ours, ref = _ours(norms, quantile=quantile, history=1000), _paper(norms, quantile)
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    np.testing.assert_array_equal(_clipped(norms, ours), _clipped(norms, ref))


@pytest.mark.parametrize("history", [1000, 20])
@pytest.mark.parametrize("quantile", [0.1, 0.5, 0.9, 1.0])
def test_include_current_false_is_the_autoclip_package(quantile, history):
    norms = _norm_sequence()
    ours = _ours(norms, quantile=quantile, history=history, include_current=False)
    ref = _package(norms, quantile, history)
    np.testing.assert_allclose(ours, ref, rtol=1e-5)
    np.testing.assert_array_equal(_clipped(norms, ours), _clipped(norms, ref))
    assert not _clipped(norms, ours)[0]  # step 1: no previous norm, τ = ∞


def test_the_spike_example():
    """Previous norms 1…10, then a spike of 100, q = 0.9: the package clips it to the
    0.9-quantile of 1…10 = 9.1; the paper's rule to that of 1…10 and 100 = 10. At q = 1.0 the
    paper's rule never clips (τ = max including the spike), the package clips to 10."""
    norms = [float(k) for k in range(1, 11)] + [100.0]
    assert _ours(norms, quantile=0.9, include_current=False)[-1] == pytest.approx(9.1, rel=1e-5)
    assert _package(norms, 0.9, 1000)[-1] == pytest.approx(9.1, rel=1e-5)
    assert _ours(norms, quantile=0.9)[-1] == pytest.approx(10.0, rel=1e-5)
    assert _paper(norms, 0.9)[-1] == pytest.approx(10.0, rel=1e-5)
    assert _ours(norms, quantile=1.0)[-1] == pytest.approx(100.0, rel=1e-6)
    assert _ours(norms, quantile=1.0, include_current=False)[-1] == pytest.approx(10.0, rel=1e-5)


def test_at_quantile_1_the_papers_rule_never_clips():
    norms = _norm_sequence()
    np.testing.assert_allclose(_ours(norms, quantile=1.0, history=7), norms, rtol=1e-6)  # fp32 grads


def test_include_current_false_survives_a_checkpoint():
    norms = _norm_sequence(40)
    a = QuantileClip(quantile=0.5, history=8, include_current=False)
    b = QuantileClip(quantile=0.5, history=8, include_current=False)
    for step, n in enumerate(norms, 1):
        g = [torch.tensor([n])]
        if step == 20:
            b.load_state_dict(a.state_dict())
        post_a = a.clip_([g[0]], g, total_norm(g), step)
        if step >= 20:
            h = [torch.tensor([n])]
            assert torch.equal(b.clip_([h[0]], h, total_norm(h), step), post_a)
