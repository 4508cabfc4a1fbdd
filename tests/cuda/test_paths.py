"""On CUDA: the fused path against the default path on a run with faults, and sparse gradients."""

import math

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine.norms import clip_global_l2_norm
from clipamp_engine.scaling import LossScaler
from clipamp_engine.step import AmpTrainState

from .helpers import CUDA, Net, batch

pytestmark = CUDA

FLOATS = ("lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss", "scaler_scale")


def _script(i: int, model: Net) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i`` with faults: inf (3) and NaN (11) gradients, a NaN loss (6), clipping spikes (5, 9)."""
    x, y = batch(i, scale=30.0 if i in (5, 9) else 1.0)
    if i == 3:
        model.poison = float("inf")
    if i == 6:
        y = y * float("nan")
    if i == 11:
        model.poison = float("nan")
    return x, y


def _run(dtype: str, fused: bool | None, steps: int = 14):
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    scaler = LossScaler("cuda", init_scale=2.0**10, growth_interval=3, enabled=dtype == "fp16")
    state = AmpTrainState(
        model, opt, F.mse_loss, dtype=dtype, max_norm=0.5, scheduler=sched, scaler=scaler, fused=fused, log_every=4
    )
    records = []
    for i in range(steps):
        records += state.step_deferred(*_script(i, model))
    records += state.flush()
    return model, opt, state, records


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_fused_path_equals_default_path(dtype, record_property):
    """Same skips, clips, scales and LR schedule; parameters and AdamW state equal within fp32 rounding
    (the fused pass multiplies by one combined unscale·clip factor, the default path applies two)."""
    m_f, o_f, st_f, rec_f = _run(dtype, None)
    m_d, o_d, st_d, rec_d = _run(dtype, False)
    assert (st_f.pipeline, st_d.pipeline) == ("fused", "default")
    assert {"nonfinite_grad", "nonfinite_loss"} <= {r.skip_reason for r in rec_d} and any(r.clipped for r in rec_d)
    for a, b in zip(rec_f, rec_d, strict=True):
        assert (a.step, a.skipped, a.skip_reason, a.clipped) == (b.step, b.skipped, b.skip_reason, b.clipped)
        for name in FLOATS:
            x, y = getattr(a, name), getattr(b, name)
            assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-5), (a.step, name, x, y)
    diffs = [float((p - q).abs().max()) for p, q in zip(m_f.parameters(), m_d.parameters())]
    record_property(f"fused_vs_default_max_abs_param_diff_{dtype}", max(diffs))
    record_property(
        f"fused_vs_default_bit_equal_{dtype}",
        all(torch.equal(p, q) for p, q in zip(m_f.parameters(), m_d.parameters())),
    )
    for p, q in zip(m_f.parameters(), m_d.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for sf, sd in zip(o_f.state.values(), o_d.state.values()):
        for name in sd:
            torch.testing.assert_close(sf[name], sd[name], rtol=1e-5, atol=1e-7)
    assert st_f.scaler.get_scale() == st_d.scaler.get_scale()


def test_sparse_cuda_grads_clip_like_the_dense_reference():
    """A sparse embedding gradient on CUDA: coalesced, kept sparse, and clipped exactly as
    ``clip_grad_norm_`` clips its dense twin (same pre-clip norm, same clipped values)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(5000, 16, sparse=True).cuda()
    dense = torch.nn.Embedding(5000, 16).cuda()
    dense.weight.data.copy_(emb.weight.data)
    ids = torch.tensor([1, 1, 7, 7, 7, 4999, 123], device="cuda")
    (emb(ids) ** 2).sum().backward()
    (dense(ids) ** 2).sum().backward()
    assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()
    pre, post = clip_global_l2_norm(emb.parameters(), 1.0)
    ref = torch.nn.utils.clip_grad_norm_(dense.parameters(), 1.0)
    assert emb.weight.grad.is_sparse and emb.weight.grad.is_cuda
    torch.testing.assert_close(pre, ref, rtol=1e-6, atol=0)
    assert float(post) == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(emb.weight.grad.to_dense(), dense.weight.grad, rtol=1e-6, atol=1e-7)


def test_sparse_embedding_trains_on_cuda():
    """``AmpTrainState`` with a sparse embedding and SGD on CUDA (bf16): steps are taken, the norm is
    the dense norm, and an inf gradient in the sparse values is a skip."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 8, sparse=True), torch.nn.Flatten(), torch.nn.Linear(32, 1))
    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = AmpTrainState(model, opt, F.mse_loss, dtype="bf16", max_norm=1e-3)
    x = torch.randint(0, 1000, (8, 4), device="cuda")
    y = torch.randn(8, 1, device="cuda")
    before = model[0].weight.detach().clone()
    log = state.step(x, y)
    assert not log.skipped and log.clipped and log.grad_l2_post_clip == pytest.approx(1e-3, rel=1e-4)
    assert not torch.equal(model[0].weight, before)
    hook = model[0].weight.register_hook(
        lambda g: torch.sparse_coo_tensor(g._indices(), g._values() * math.inf, g.shape)
    )
    frozen = model[0].weight.detach().clone()
    log = state.step(x, y)
    hook.remove()
    assert log.skipped and log.skip_reason == "nonfinite_grad" and torch.equal(model[0].weight, frozen)
