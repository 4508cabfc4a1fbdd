"""The GPT's attention: the explicit form equals ``F.scaled_dot_product_attention``, and ``auto`` picks it
only for bf16 on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sweep.config.schema import ATTENTION
from sweep.tasks import models
from sweep.tasks.models import GPT, eager_attention


def qkv(dtype=torch.float64, shape=(3, 2, 17, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]


def test_eager_equals_sdpa_in_float64_values_and_gradients():
    a, b = qkv(), qkv()
    out_e, out_s = eager_attention(*a, 0.0), F.scaled_dot_product_attention(*b, is_causal=True)
    torch.testing.assert_close(out_e, out_s, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out_e)
    out_e.backward(grad)
    out_s.backward(grad)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)


def test_eager_is_causal():
    q, k, v = qkv()
    out = eager_attention(q, k, v, 0.0)
    v2 = v.detach().clone()
    v2[..., 5:, :] += 100.0  # the future of position 4
    k2 = k.detach().clone()
    k2[..., 5:, :] -= 3.0
    torch.testing.assert_close(eager_attention(q, k2, v2, 0.0)[..., :5, :], out[..., :5, :], rtol=0, atol=1e-12)


def test_eager_in_bf16_is_as_close_to_float64_as_sdpa():
    ref = F.scaled_dot_product_attention(*qkv(shape=(4, 4, 128, 32)), is_causal=True)
    low = [t.detach().bfloat16() for t in qkv(shape=(4, 4, 128, 32))]
    err_e = (eager_attention(*low, 0.0).double() - ref).abs().max()
    err_s = (F.scaled_dot_product_attention(*low, is_causal=True).double() - ref).abs().max()
    assert err_e <= 2 * err_s + 1e-3, (err_e, err_s)


def test_cpu_bf16_softmax_is_the_fp32_softmax_rounded_once():
    """What lets the explicit form keep its softmax in bf16 on CPU."""
    scores = torch.randn(64, 128, 128, generator=torch.Generator().manual_seed(1)) * 4
    scores[..., 100:] = float("-inf")
    low = scores.bfloat16()
    assert torch.equal(low.softmax(-1), low.float().softmax(-1).bfloat16())


@pytest.mark.parametrize(
    "dtype, attention, eager",
    [
        (torch.bfloat16, "auto", True),
        (torch.float32, "auto", False),
        (torch.float16, "auto", False),
        (torch.float32, "eager", True),
        (torch.bfloat16, "sdpa", False),
    ],
)
def test_gpt_uses_the_chosen_form(dtype, attention, eager):
    """The model's output equals (``torch.equal``) a control that forces the expected form."""
    torch.manual_seed(0)
    model = GPT(d_model=32, n_layer=1, n_head=2, block_size=16, attention=attention)
    control = GPT(d_model=32, n_layer=1, n_head=2, block_size=16, attention="eager" if eager else "sdpa")
    control.load_state_dict(model.state_dict())
    idx = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        assert torch.equal(model(idx), control(idx))


def test_unknown_attention_is_a_one_line_error_and_choices_match_the_schema():
    with pytest.raises(ValueError, match=r"model.attention='flash' is not one of auto, sdpa, eager"):
        GPT(attention="flash")
    assert models.ATTENTION == ATTENTION


def test_eager_dropout_only_in_training():
    torch.manual_seed(0)
    model = GPT(d_model=32, n_layer=1, n_head=2, block_size=16, dropout=0.5, attention="eager")
    idx = torch.randint(0, 256, (2, 16))
    model.eval()
    assert torch.equal(model(idx), model(idx))
    model.train()
    assert not torch.equal(model(idx), model(idx))
