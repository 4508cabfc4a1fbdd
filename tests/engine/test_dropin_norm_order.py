"""Nothing changes until asked: at the same τ the engine's step is the canonical torch recipe, bit for bit.

The canonical recipe (PyTorch's AMP recipe, nanoGPT's ``train.py``)::

    for each of k equal micro-batches:            # tensor_split of the batch
        with torch.autocast(device, dtype):
            loss = loss_fn(model(x), y)           # a mean loss
        scaler.scale(loss / k).backward()
    scaler.unscale_(optimizer)
    norm = clip_grad_norm_(model.parameters(), τ)
    scaler.step(optimizer); scaler.update(); optimizer.zero_grad(set_to_none=True)

The model is nanoGPT-shaped with nanoGPT's two param groups (decay first, then no-decay), so the
optimizer's group order differs from ``model.parameters()`` order; τ sits below the typical norm so
that most steps clip and a one-ulp difference would grow.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_, get_total_norm

from clipamp_engine.step import AmpTrainState

from .nanogpt_shaped import NanoGPTShaped, batches, configure_optimizers

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _lm_loss(out, y):
    logits = out[0]
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))


def _model(size):
    torch.manual_seed(0)
    model = NanoGPTShaped(**size)
    return model, configure_optimizers(model)


def canonical(dtype, data, tau, k, size):
    """The recipe above; returns (pre-clip norms, group-order norms, model)."""
    model, opt = _model(size)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == "fp16")
    norms, group_order = [], []
    for x, y in data:
        for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
            with torch.autocast("cpu", dtype=AUTOCAST[dtype], enabled=dtype != "fp32"):
                loss = _lm_loss(model(xm), ym)
            scaler.scale(loss / k).backward()
        scaler.unscale_(opt)
        group_order.append(get_total_norm([p.grad for g in opt.param_groups for p in g["params"]]))
        norms.append(clip_grad_norm_(model.parameters(), tau))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return torch.stack(norms), torch.stack(group_order), model


def engine(dtype, data, tau, k, size):
    model, opt = _model(size)
    state = AmpTrainState(model, opt, _lm_loss, dtype=dtype, max_norm=tau, accumulation_steps=k)
    norms = [state.step(x, y).grad_l2_pre_clip for x, y in data]
    return torch.tensor(norms, dtype=torch.float32), model


SMALL = dict(vocab=64, block=16, d=32, n_layer=2, n_head=2)
TINY = dict(vocab=32, block=8, d=16, n_layer=1, n_head=2)


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "dtype, k, size, tau",
    [
        ("bf16", 2, TINY, 0.25),
        pytest.param("bf16", 1, SMALL, 0.25, marks=SLOW),
        pytest.param("bf16", 3, SMALL, 0.25, marks=SLOW),
        pytest.param("fp32", 1, SMALL, 0.25, marks=SLOW),
        pytest.param("fp32", 2, SMALL, 0.25, marks=SLOW),
        pytest.param("fp16", 1, TINY, 0.25, marks=SLOW),
        pytest.param("fp16", 2, TINY, 0.25, marks=SLOW),
    ],
)
def test_engine_step_is_the_canonical_recipe_bit_for_bit(dtype, k, size, tau):
    data = batches(60, batch=12, block=size["block"], vocab=size["vocab"])
    ref_norms, group_order, ref = canonical(dtype, data, tau, k, size)
    norms, got = engine(dtype, data, tau, k, size)
    finite = torch.isfinite(ref_norms)
    assert (ref_norms[finite] > tau).float().mean() > 0.5  # most steps clip
    assert torch.equal(torch.isfinite(norms), finite)  # fp16: the same overflow steps skipped
    assert torch.equal(norms[finite], ref_norms[finite])
    for (name, p), q in zip(ref.named_parameters(), got.parameters()):
        assert torch.equal(p, q), name
    if dtype != "fp16":  # the comparison can fail: summed in the optimizer's group order, norms differ
        assert not torch.equal(group_order, ref_norms)


def test_the_norm_sums_the_optimizers_parameters_in_model_order():
    """Parameters the optimizer does not hold are neither normed nor clipped, as they are never updated."""
    model, _ = _model(TINY)
    head = list(model.h.parameters())
    opt = torch.optim.SGD([{"params": head[::-1]}], lr=0.1)
    state = AmpTrainState(model, opt, _lm_loss, dtype="fp32")
    assert [id(p) for p in state.params] == [id(p) for p in head]


def test_a_parameter_the_optimizer_holds_outside_the_model_is_normed_and_clipped_after_the_models():
    """A loss module's learnable weight (uncertainty weighting, Kendall et al. 2018) in the optimizer: the
    engine equals, bit for bit, the loop clipping ``[*model.parameters(), *loss_fn.parameters()]``."""

    class WeightedLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.log_var = torch.nn.Parameter(torch.zeros(()))

        def forward(self, out, y):
            return torch.exp(-self.log_var) * F.mse_loss(out, y) + self.log_var

    def make():
        torch.manual_seed(0)
        model, crit = (
            torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)),
            WeightedLoss(),
        )
        return model, crit, torch.optim.AdamW([*crit.parameters(), *model.parameters()], lr=1e-2)

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 8, generator=g), 3 * torch.randn(16, 1, generator=g)) for _ in range(10)]
    model, crit, opt = make()
    norms = []
    for x, y in data:
        crit(model(x), y).backward()
        norms.append(clip_grad_norm_([*model.parameters(), *crit.parameters()], 0.5).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    model2, crit2, opt2 = make()
    state = AmpTrainState(model2, opt2, crit2, dtype="fp32", max_norm=0.5, fused=False)
    assert [state.step(x, y).grad_l2_pre_clip for x, y in data] == norms
    assert sum(n > 0.5 for n in norms) > 5  # the clip is active
    for p, q in zip([*model.parameters(), *crit.parameters()], [*model2.parameters(), *crit2.parameters()]):
        assert torch.equal(p, q)
