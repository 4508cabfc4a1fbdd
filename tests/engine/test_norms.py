"""Global-norm clipping: the seed's smoke tests and equivalence with torch's clip_grad_norm_."""

import math

import pytest
import torch

from clipamp_engine import clip_global_l2_norm, has_non_finite_grad, total_norm


def _param(grad):
    p = torch.nn.Parameter(torch.zeros_like(torch.as_tensor(grad, dtype=torch.float32)))
    p.grad = torch.as_tensor(grad, dtype=torch.float32).clone()
    return p


def test_returns_pre_clip_norm_and_projects_on_the_ball():
    p = _param([3.0, 4.0])
    pre, post = clip_global_l2_norm([p], max_norm=1.0)
    assert float(pre) == pytest.approx(5.0)
    assert float(post) == pytest.approx(1.0, abs=1e-6)
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.8]), atol=1e-6)  # direction kept
    assert float(p.grad.norm()) == pytest.approx(float(post), abs=1e-6)


def test_no_clip_below_threshold_returns_equal_norms():
    p = _param([0.3, 0.4])
    pre, post = clip_global_l2_norm([p], max_norm=1.0)
    assert float(pre) == pytest.approx(0.5) and float(post) == pytest.approx(0.5)
    assert torch.equal(p.grad, torch.tensor([0.3, 0.4]))


@pytest.mark.parametrize("max_norm", [0.01, 0.5, 3.0, 1e6])
def test_equivalent_to_torch_clip_grad_norm(max_norm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(17, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5))
    model(torch.randn(8, 17)).pow(2).sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    ref_params = [torch.nn.Parameter(torch.zeros_like(g)) for g in reference]
    for p, g in zip(ref_params, reference):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    pre, post = clip_global_l2_norm(model.parameters(), max_norm)
    assert torch.equal(pre, ref_norm)
    for p, r in zip(model.parameters(), ref_params):
        assert torch.equal(p.grad, r.grad)
    assert float(post) == pytest.approx(
        float(torch.stack([p.grad.norm() for p in model.parameters()]).norm()), rel=1e-5
    )
    assert float(post) <= max_norm * (1 + 1e-6) or max_norm > float(pre)


def test_none_grads_skipped_and_empty_is_zero():
    a, b = _param([3.0, 4.0]), torch.nn.Parameter(torch.ones(3))
    pre, _ = clip_global_l2_norm([a, b], 10.0)
    assert float(pre) == pytest.approx(5.0)
    pre, post = clip_global_l2_norm([b], 1.0)
    assert float(pre) == 0.0 and float(post) == 0.0


def test_clip_after_accumulation_differs_from_clip_per_micro_batch():
    """Seed 004 test 2: g1=(10,0), g2=(-10,1), τ=1."""
    g1, g2 = torch.tensor([10.0, 0.0]), torch.tensor([-10.0, 1.0])
    p = _param((g1 + g2) / 2)
    clip_global_l2_norm([p], 1.0)
    assert torch.allclose(p.grad, torch.tensor([0.0, 0.5]))  # mean (0, .5) is under τ: untouched
    per_micro = []
    for g in (g1, g2):
        q = _param(g)
        clip_global_l2_norm([q], 1.0)
        per_micro.append(q.grad)
    clipped_then_mean = (per_micro[0] + per_micro[1]) / 2
    assert torch.allclose(clipped_then_mean, torch.tensor([0.0025, 0.04975]), atol=1e-4)
    assert not torch.allclose(clipped_then_mean, p.grad)


def test_sharded_norm_equals_full_norm():
    """Seed 004 test 3: shards (3,4) and (0,12) have global norm 13 and one shared scale."""
    a, b = _param([3.0, 4.0]), _param([0.0, 12.0])
    pre, post = clip_global_l2_norm([a, b], 1.0)
    assert float(pre) == pytest.approx(13.0)
    assert torch.allclose(torch.cat([a.grad, b.grad]), torch.tensor([3.0, 4.0, 0.0, 12.0]) / 13, atol=1e-6)
    assert float(post) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_fails_closed(bad):
    """Seed 004 test 4: non-finite grads are reported, never 'clipped' into the weights."""
    p, q = _param([bad, 1.0]), _param([3.0, 4.0])
    assert has_non_finite_grad([p, q])
    pre, _ = clip_global_l2_norm([p, q], 1.0)
    assert not math.isfinite(float(pre))
    assert torch.equal(q.grad, torch.tensor([3.0, 4.0]))  # finite neighbours untouched too
    assert not has_non_finite_grad([q])


def test_sparse_grads_coalesced_and_never_densified():
    emb = torch.nn.Embedding(1000, 4, sparse=True)
    emb(torch.tensor([1, 1, 7, 7, 7, 999])).sum().backward()
    dense = emb.weight.grad.to_dense()
    assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()  # repeated ids
    pre, post = clip_global_l2_norm(emb.parameters(), 1.0)
    assert emb.weight.grad.is_sparse
    assert float(pre) == pytest.approx(float(dense.norm()), rel=1e-6)
    assert torch.allclose(emb.weight.grad.to_dense(), dense * min(1.0, 1.0 / (float(pre) + 1e-6)))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_total_norm_of_an_uncoalesced_sparse_grad_is_its_dense_norm(norm_type):
    """``total_norm`` alone (no ``grads_of`` before it) norms the gradient, not its duplicated raw values."""
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 1, 2])).sum().backward()
    grad = emb.weight.grad
    assert not grad.is_coalesced()
    expected = torch.nn.utils.get_total_norm([grad.to_dense()], norm_type)
    assert torch.equal(total_norm([grad], norm_type), expected)
    assert not grad.is_coalesced()  # measured, not mutated


def test_half_grads_accumulate_in_fp32():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p.grad = torch.full((4,), 60000.0, dtype=torch.float16)  # squares overflow fp16
    assert float(total_norm([p.grad])) == pytest.approx(120000.0, rel=1e-3)


def test_max_norm_must_be_positive():
    with pytest.raises(ValueError, match="max_norm=0"):
        clip_global_l2_norm([_param([1.0])], 0)
