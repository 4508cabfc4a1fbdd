"""Norms in at least fp32, fp64 kept: parity with torch on float64 gradients (issue 11, item 1).

References (the behaviour these tests hold clipamp to):
    ``torch.nn.utils.get_total_norm`` / ``clip_grad_norm_`` (torch 2.13), which norm fp64
    gradients in fp64; and the non-finite table of torch's own test
    ``test_clip_grad_norm_error_if_nonfinite`` (``test/test_nn.py``, float64 parameters), as
    ported to C++ in pytorch/pytorch ``test/cpp/api/nn_utils.cpp``
    (``TEST_F(NNUtilsTest, ClipGradNormErrorIfNonfinite)``, read at commit 04821b97).
"""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from clipamp_engine import AmpTrainState, clip_global_l2_norm, has_non_finite_grad, total_norm
from clipamp_engine.clip import CLIP_MODES, make_clip_policy

from .clip.helpers import _batches, _clip, _state

inf, nan = math.inf, math.nan
NORM_TYPES = [0.5, 1.0, 2.0, 4.0, inf]


def _grads(dtypes, seed=0, sparse_at=None):
    """One gradient per dtype (different sizes and scales); ``sparse_at``: index of a COO one."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, dtype in enumerate(dtypes):
        g = (torch.randn(7 + 5 * i, 3, generator=gen, dtype=torch.float64) * 10.0 ** (i - 1)).to(dtype)
        if i == sparse_at:
            # duplicate index 4: coalescing sums two rows, as clipamp's grads_of does
            g = torch.sparse_coo_tensor(torch.tensor([[0, 4, 4, 9]]), g[:4], (12, 3), check_invariants=True).coalesce()
        out.append(g)
    return out


def _params(grads):
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
        p.grad = g.clone()
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_fp64_total_norm_equals_torch_get_total_norm(norm_type):
    grads = _grads([torch.float64] * 4)
    ours = total_norm(grads, norm_type)
    ref = torch.nn.utils.get_total_norm(grads, norm_type)
    assert ours.dtype == torch.float64 == ref.dtype
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_fp64_stays_fp64_beyond_the_fp32_range(norm_type):
    """Entries of 1e30 square to 1e60: finite in fp64 (torch), inf if accumulated in fp32."""
    grads = [torch.full((5,), 1e30, dtype=torch.float64), torch.full((3,), -2e30, dtype=torch.float64)]
    ours = total_norm(grads, norm_type)
    assert math.isfinite(float(ours)) and ours.dtype == torch.float64
    torch.testing.assert_close(ours, torch.nn.utils.get_total_norm(grads, norm_type), rtol=1e-12, atol=0)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float64),
        (torch.bfloat16, torch.float32, torch.float64),
        (torch.float16, torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_mixed_dtypes_match_torch_and_accumulate_in_at_least_fp32(norm_type, dtypes):
    """Same value as torch; never narrower than fp32 (torch returns an fp16 norm for fp16
    grads, so its value carries fp16 rounding: compare at that tolerance, and ours against the
    exact fp64 norm of the same values at fp32 tolerance)."""
    grads = _grads(list(dtypes))
    ours = total_norm(grads, norm_type)
    want = torch.float64 if torch.float64 in dtypes else torch.float32
    assert ours.dtype == want
    ref = torch.nn.utils.get_total_norm(grads, norm_type)
    torch.testing.assert_close(ours.double(), ref.double(), rtol=1e-2, atol=0)
    exact = torch.nn.utils.get_total_norm([g.double() for g in grads], norm_type)
    torch.testing.assert_close(ours.double(), exact, rtol=2e-6, atol=0)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_fp64_sparse_gradient_normed_in_fp64(norm_type):
    grads = _grads([torch.float32, torch.float64, torch.float64], sparse_at=1)
    assert grads[1].is_sparse and grads[1].dtype == torch.float64
    ours = total_norm(grads, norm_type)
    dense = [g.to_dense() if g.is_sparse else g for g in grads]
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, torch.nn.utils.get_total_norm(dense, norm_type), rtol=1e-12, atol=0)


def test_fp64_clip_equals_torch_clip_grad_norm():
    grads = _grads([torch.float64, torch.float32, torch.float64], sparse_at=None)
    ours, ref = _params(grads), _params(grads)
    pre, post = clip_global_l2_norm(ours, 0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
    assert pre.dtype == torch.float64
    torch.testing.assert_close(pre, ref_norm, rtol=1e-12, atol=0)
    for a, b in zip(ours, ref):
        assert a.grad.dtype == b.grad.dtype
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6 if a.grad.dtype == torch.float32 else 1e-12, atol=0)
    assert float(post) == pytest.approx(0.5, rel=1e-6)


# -- torch's non-finite table (float64 parameters) -------------------------------------------
NORMS_POS = [0.1, 1, 2, 3.5, inf]
NORMS_NEG = [-0.1, -1, -2, -3.5]
NORMS_EXCEPT_0 = NORMS_POS + NORMS_NEG
NORMS_ALL = NORMS_EXCEPT_0 + [0]
# (grad_only_one_elem, prefix_finite_grad_param, scalars, norms_nonfinite, norms_finite)
TORCH_NONFINITE_TABLE = [
    # errors from an infinite grad
    (False, False, [inf, -inf], NORMS_EXCEPT_0, [0]),
    (False, True, [inf, -inf], NORMS_POS, NORMS_NEG + [0]),
    (True, False, [inf, -inf], NORMS_POS, NORMS_NEG + [0]),
    (True, True, [inf, -inf], NORMS_POS, NORMS_NEG + [0]),
    # errors from a NaN grad
    (False, False, [nan], NORMS_EXCEPT_0, [0]),
    (False, True, [nan], NORMS_EXCEPT_0, [0]),
    (True, False, [nan], NORMS_EXCEPT_0, [0]),
    (True, True, [nan], NORMS_EXCEPT_0, [0]),
    # a grad that should never error
    (False, False, [2e22, -2e22], [], NORMS_ALL),
    (False, True, [2e22, -2e22], [], NORMS_ALL),
    (True, False, [2e22, -2e22], [], NORMS_ALL),
    (True, True, [2e22, -2e22], [], NORMS_ALL),
    # a grad that overflows to inf for only some norm orders
    (False, False, [2e200, -2e200], [3.5, 2, -2, -3.5], [inf, 1, 0.1, 0, -1, -0.1]),
    (False, True, [2e200, -2e200], [3.5, 2], NORMS_NEG + [inf, 1, 0.1, 0]),
    (True, False, [2e200, -2e200], [3.5, 2], NORMS_NEG + [inf, 1, 0.1, 0]),
    (True, True, [2e200, -2e200], [3.5, 2], NORMS_NEG + [inf, 1, 0.1, 0]),
]


def _torch_table_params(scalar, grad_only_one_elem, prefix_finite_grad_param):
    """torch's ``gen_parameters``: ten float64 ones times ``scalar`` (or only element 1),
    optionally after a float64 parameter whose grad is 1."""
    param = torch.ones(10, dtype=torch.float64, requires_grad=True)
    (param[1] if grad_only_one_elem else param).mul(scalar).sum().backward()
    params = [param]
    if prefix_finite_grad_param:
        prefix = torch.ones(1, dtype=torch.float64, requires_grad=True)
        prefix.mul(1).sum().backward()
        params.insert(0, prefix)
    return params


def _table_cases():
    for one, prefix, scalars, nonfinite, finite in TORCH_NONFINITE_TABLE:
        for scalar in scalars:
            for p in nonfinite:
                yield one, prefix, scalar, p, False
            for p in finite:
                yield one, prefix, scalar, p, True


@pytest.mark.parametrize("one,prefix,scalar,norm_type,finite", list(_table_cases()))
def test_torch_nonfinite_table_total_norm(one, prefix, scalar, norm_type, finite):
    grads = [p.grad for p in _torch_table_params(scalar, one, prefix)]
    ours = total_norm(grads, norm_type)
    assert ours.dtype == torch.float64
    assert math.isfinite(float(ours)) == finite
    # and the same value as torch, nan for nan, inf for inf
    torch.testing.assert_close(
        ours, torch.nn.utils.get_total_norm(grads, norm_type), rtol=1e-12, atol=0, equal_nan=True
    )


@pytest.mark.parametrize("one,prefix,scalar", sorted({(c[0], c[1], c[2]) for c in _table_cases()}, key=str))
def test_torch_nonfinite_table_check_and_l2_clip(one, prefix, scalar):
    """``has_non_finite_grad`` is true exactly for the inf/NaN grads of the table; the L2 clip
    reports a non-finite ``pre`` exactly where the table's L2 row is non-finite and then leaves
    the gradients untouched (torch: 'Grads should not change if error is thrown'); otherwise
    it clips like ``clip_grad_norm_``."""
    l2_finite = next(f for o, p, s, n, f in _table_cases() if (o, p, repr(s), n) == (one, prefix, repr(scalar), 2))
    params = _torch_table_params(scalar, one, prefix)
    assert has_non_finite_grad(params) == (not math.isfinite(scalar))
    before = [p.grad.clone() for p in params]
    pre, _ = clip_global_l2_norm(params, 1.0)
    assert math.isfinite(float(pre)) == l2_finite
    if not l2_finite:
        for p, b in zip(params, before):
            torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)
    else:
        ref = _torch_table_params(scalar, one, prefix)
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-12, atol=0)


# -- an fp64 model through AmpTrainState, every clip mode ------------------------------------


@pytest.mark.parametrize("mode", sorted(CLIP_MODES))
def test_every_clip_mode_trains_an_fp64_model(mode):
    """An fp64 model (``dtype="fp32"``: no autocast) trains in every clip mode: parameters stay
    fp64 and finite, and the recorded pre-clip norm of step 1 equals
    ``torch.nn.utils.get_total_norm`` over the gradients of a plain fp64 backward on a copy of
    the model (dpsgd records its own per-example quantity, so only its dtype and finiteness)."""
    state = _state(mode, fp64=True)
    batches = _batches(3, fp64=True)
    ref = copy.deepcopy(state.model)
    nn.functional.cross_entropy(ref(batches[0][0]), batches[0][1]).backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    records = [state.step(x, y) for x, y in batches]
    assert not any(r.skipped for r in records)
    assert all(p.dtype == torch.float64 and torch.isfinite(p).all() for p in state.model.parameters())
    assert all(
        math.isfinite(r.grad_l2_pre_clip) and r.grad_l2_post_clip <= r.grad_l2_pre_clip * (1 + 1e-6) for r in records
    )
    if mode != "dpsgd":
        assert records[0].grad_l2_pre_clip == pytest.approx(float(ref_norm), rel=1e-12)


def test_an_fp64_model_with_a_fused_optimizer_takes_the_default_path():
    """torch's fused AdamW kernel takes ``grad_scale`` in fp32 only (an fp64 one raises
    "expected scalar type Float"), so an fp64 model keeps the default path, where the clip is
    applied in fp64: the update equals torch's ``clip_grad_norm_`` + fused ``AdamW`` on a copy.
    ``fused=True`` says why it cannot run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8, dtype=torch.float64) * 3, torch.randint(0, 3, (8,))
    state = AmpTrainState(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
        nn.functional.cross_entropy,
        dtype="fp32",
        max_norm=0.5,
    )
    assert state.pipeline == "default"
    record = state.step(x, y)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    nn.functional.cross_entropy(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()
    assert record.grad_l2_pre_clip == pytest.approx(float(ref_norm), rel=1e-12) and record.clipped
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="fused=True: the fused path cannot run: fp64 parameters"):
        AmpTrainState(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
            nn.functional.cross_entropy,
            dtype="fp32",
            max_norm=0.5,
            fused=True,
        )


def test_autoclip_and_zclip_keep_an_fp64_models_norms_in_fp64():
    """Norms beyond the fp32 range (1e40) that differ only at 1e-12: AutoClip's τ is numpy's fp64
    quantile of the history (the paper's code takes ``np.percentile`` of the float64 norms) and
    ZClip's warm-up statistics are numpy's mean and population variance (the authors' ZClip
    takes them with ``torch.tensor(...).mean()/.var(unbiased=False)`` of the norms it was
    handed); both survive a checkpoint in fp64."""
    norms = [1e40 * (1 + k * 1e-12) for k in range(8)]
    quantile = make_clip_policy("quantile", quantile=0.5, history=100)
    zscore = make_clip_policy("zscore", warmup_steps=len(norms), z_thresh=2.5)
    for t, n in enumerate(norms, start=1):
        for policy in (quantile, zscore):
            p = nn.Parameter(torch.zeros(1, dtype=torch.float64))
            p.grad = torch.tensor([n], dtype=torch.float64)
            _clip(policy, [p], step=t)
        assert quantile.threshold == np.quantile(norms[:t], 0.5)  # exact: linear interpolation in fp64
    assert float(zscore.mean) == pytest.approx(np.mean(norms), rel=1e-15)
    assert float(zscore.var) == pytest.approx(np.var(norms), rel=1e-6) and float(zscore.var) > 0  # fp32: 0 or inf
    for policy in (quantile, zscore):
        state = policy.state_dict()
        again = make_clip_policy(
            policy.mode,
            **({"quantile": 0.5, "history": 100} if policy.mode == "quantile" else {"warmup_steps": len(norms)}),
        )
        again.load_state_dict(state)
        assert again.state_dict().keys() == state.keys()
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.numel():
                assert again.state_dict()[k].dtype == torch.float64 and torch.equal(again.state_dict()[k], v)


@pytest.mark.parametrize("k", [1, 3])
def test_an_fp64_model_with_accumulation_equals_the_canonical_loop(k):
    """``(loss / k).backward()`` per micro-batch, ``clip_grad_norm_``, step: an fp64 loss is weighted in fp64
    (fp32(1/3) would change every gradient) and recorded unrounded."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    model = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (x, x.sum(1, keepdim=True) * 3)
        for x in (torch.randn(12, 6, generator=gen, dtype=torch.float64) for _ in range(4))
    ]
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    norms, losses = [], []
    for inputs, targets in batches:
        total = 0.0
        for x, y in zip(inputs.tensor_split(k), targets.tensor_split(k)):
            loss = nn.functional.mse_loss(ref(x), y)
            total += loss.item() * len(x)
            (loss / k).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item())
        losses.append(total / len(inputs))
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = AmpTrainState(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        nn.functional.mse_loss,
        dtype="fp32",
        max_norm=0.5,
        accumulation_steps=k,
    )
    logs = [state.step(x, y) for x, y in batches]
    assert [log.grad_l2_pre_clip for log in logs] == norms
    assert [log.loss for log in logs] == pytest.approx(losses, rel=1e-15)  # not rounded to fp32 (≈1e-8)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_an_fp64_models_update_norm_columns_stay_fp64():
    """``clip=update`` on an fp64 model: ``update_l2_pre_clip`` equals the norm of AdamW's own data update
    (decoupled decay apart) to fp64 rounding; it was rounded to fp32 on its way into the record (2e-8 off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    ref = copy.deepcopy(model)
    lr, wd = 0.05, 0.1
    state = AmpTrainState(
        model,
        torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd),
        nn.functional.mse_loss,
        dtype="fp32",
        clip=make_clip_policy("update", max_update_norm=1e3),  # never clips: the ref needs no clip
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=wd)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = (
            torch.randn(8, 4, generator=gen, dtype=torch.float64),
            torch.randn(8, 1, generator=gen, dtype=torch.float64),
        )
        record = state.step(x, y)
        nn.functional.mse_loss(ref(x), y).backward()
        before = [p.detach().clone() for p in ref.parameters()]
        ref_opt.step()
        ref_opt.zero_grad()
        data = [p.detach() - b * (1 - lr * wd) for p, b in zip(ref.parameters(), before)]
        want = float(torch.linalg.vector_norm(torch.cat([d.flatten() for d in data])))
        assert record.extra["update_l2_pre_clip"] == pytest.approx(want, rel=1e-12, abs=0)
