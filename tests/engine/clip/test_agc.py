"""AGC (NFNets unit-wise clipping) against the paper's rule and timm's reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from clipamp_engine.clip import AdaptiveGradClip, make_clip_policy, unitwise_norm

from .helpers import _clip, _params_with_grads

# -- AGC --------------------------------------------------------------------------------------


def test_agc_acceptance_fixture_row_units():
    """ones(2,3) weights, grad 10·ones, λ=0.01: each row's weight norm is √3, its max grad norm
    0.01·√3; the row gradient 10·ones(3) (norm 10√3) is scaled to 0.01√3, i.e. 0.01 per entry."""
    (w,) = _params_with_grads(10 * torch.ones(2, 3), values=[torch.ones(2, 3)])
    pre, post = _clip(make_clip_policy("agc", clip_factor=0.01), [w])
    torch.testing.assert_close(w.grad, torch.full((2, 3), 0.01))
    torch.testing.assert_close(post, torch.tensor(0.01 * math.sqrt(6)))


def _timm_unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """timm's ``unitwise_norm`` (huggingface/pytorch-image-models ``timm/utils/agc.py``): the
    tensor's own ``norm``, so fp64 norms in fp64."""
    return x.norm(2.0) if x.ndim <= 1 else x.norm(2.0, dim=tuple(range(1, x.ndim)), keepdim=True)


def _timm_agc_reference(p: torch.Tensor, g: torch.Tensor, clip_factor: float, eps: float) -> torch.Tensor:
    """timm's ``adaptive_clip_grad`` for one parameter (same file)."""
    max_norm = _timm_unitwise_norm(p).clamp(min=eps) * clip_factor
    grad_norm = _timm_unitwise_norm(g)
    clipped = g * (max_norm / grad_norm.clamp(min=1e-6))
    return torch.where(grad_norm < max_norm, g, clipped)


def test_agc_matches_unitwise_reference_on_conv_and_linear_and_skips_1d():
    torch.manual_seed(0)
    conv, lin = nn.Conv2d(3, 4, 3), nn.Linear(5, 6)
    model = nn.Sequential(conv, nn.Flatten(), lin)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * torch.rand(()) * 0.3
    p_conv = (conv.weight.detach().clone(), conv.weight.grad.clone())
    p_lin = (lin.weight.detach().clone(), lin.weight.grad.clone())
    bias_grad = lin.bias.grad.clone()
    _clip(make_clip_policy("agc", clip_factor=0.05, named_params=model), list(model.parameters()))
    torch.testing.assert_close(conv.weight.grad, _timm_agc_reference(*p_conv, 0.05, 1e-3))
    torch.testing.assert_close(lin.weight.grad, _timm_agc_reference(*p_lin, 0.05, 1e-3))
    assert torch.equal(lin.bias.grad, bias_grad)  # 1-D excluded by default


def test_agc_on_fp64_parameters_matches_timm_in_fp64():
    """fp64 weights and gradients: unit norms accumulate in fp64 (timm norms in the tensor's own
    dtype), so the clipped gradient equals timm's to fp64 precision, including entries far
    outside the fp32 range (which an fp32 reduction would turn into inf)."""
    torch.manual_seed(0)
    conv, lin = nn.Conv2d(3, 4, 3).double(), nn.Linear(5, 6).double()
    model = nn.Sequential(conv, nn.Flatten(), lin)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 0.3
    lin.weight.grad[0] *= 1e200  # one unit far beyond fp32
    refs = [(m.weight.detach().clone(), m.weight.grad.clone()) for m in (conv, lin)]
    assert torch.isinf(unitwise_norm(lin.weight.grad.float())).any()  # an fp32 reduction overflows
    assert unitwise_norm(lin.weight.grad).dtype == torch.float64
    _clip(make_clip_policy("agc", clip_factor=0.05, named_params=model), list(model.parameters()))
    for m, (p, g) in zip((conv, lin), refs):
        assert m.weight.grad.dtype == torch.float64
        torch.testing.assert_close(m.weight.grad, _timm_agc_reference(p, g, 0.05, 1e-3), rtol=1e-12, atol=0)
    assert torch.isfinite(lin.weight.grad).all()


def test_agc_excludes_embeddings_by_type_and_name():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(4, 3)
            self.word_embeddings = nn.Parameter(torch.ones(4, 3))
            self.proj = nn.Linear(3, 3, bias=False)

    m = M()
    for p in m.parameters():
        p.grad = torch.full_like(p, 100.0)
    _clip(make_clip_policy("agc", named_params=m), list(m.parameters()))
    assert torch.equal(m.tok.weight.grad, torch.full((4, 3), 100.0))
    assert torch.equal(m.word_embeddings.grad, torch.full((4, 3), 100.0))
    assert m.proj.weight.grad.abs().max() < 1.0
    # configurable: exclude nothing by name, keep 1-D exclusion
    for p in m.parameters():
        p.grad = torch.full_like(p, 100.0)
    _clip(AdaptiveGradClip(exclude=[], named_params=m), list(m.parameters()))
    assert m.word_embeddings.grad.abs().max() < 1.0


def test_an_exclude_pattern_that_matches_no_name_is_refused():
    """A typo'd exclusion would leave the layer clipped (its gradient ×0.01 of the weight) without a word."""
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"agc exclude: 'haed' matches no parameter name \(names look like 0\.weight"):
        make_clip_policy("agc", exclude=["haed"], named_params=m)
    policy = make_clip_policy("agc", exclude=[r"^1\."], named_params=m)  # the final layer, as the paper leaves it
    for p in m.parameters():
        p.grad = torch.full_like(p, 100.0)
    _clip(policy, list(m.parameters()))
    assert torch.equal(m[1].weight.grad, torch.full((2, 3), 100.0))
    assert m[0].weight.grad.abs().max() < 1.0


def test_agc_built_without_named_params_excludes_the_models_embeddings_through_the_state():
    """``AmpTrainState(model, ..., clip=make_clip_policy("agc"))`` in a loop of one's own: the policy had no
    names, so the default exclusions (embeddings) fell away and a token embedding was clipped, unlike the
    runner's ``clip=agc`` (which passes the model). The state binds its model: the same run either way."""
    from clipamp_engine import AmpTrainState

    def run(named):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
        clip = make_clip_policy("agc", clip_factor=0.01, **({"named_params": model} if named else {}))
        state = AmpTrainState(
            model, torch.optim.SGD(model.parameters(), lr=1.0), nn.functional.cross_entropy, clip=clip
        )
        x = torch.arange(10)
        return [state.step(x, x).grad_l2_post_clip for _ in range(2)], model[0].weight.detach()

    (with_names, emb_a), (without, emb_b) = run(True), run(False)
    assert with_names == without and torch.equal(emb_a, emb_b)
