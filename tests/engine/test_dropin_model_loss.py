"""Models that compute their own loss train through ``AmpTrainState(model, optimizer)`` without an adapter."""

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine.model_loss import EXPECTED_MODEL_OUTPUT
from clipamp_engine.step import AmpTrainState

from .nanogpt_shaped import NanoGPTShaped, batches, configure_optimizers

TINY = dict(vocab=32, block=8, d=16, n_layer=1, n_head=2)


def _pair():
    torch.manual_seed(0)
    model = NanoGPTShaped(**TINY)
    return model, configure_optimizers(model)


@pytest.mark.slow  # 20 accumulated steps of a nanoGPT-shaped model, twice
def test_a_model_returning_logits_and_loss_is_the_canonical_recipe_bit_for_bit():
    """nanoGPT's loop: ``_, loss = model(x, y)`` under autocast, ``loss / k``, clip, step."""
    data, tau, k = batches(20, batch=8, block=8, vocab=32), 0.25, 2
    ref, opt = _pair()
    ref_norms = []
    for x, y in data:
        for xm, ym in zip(x.tensor_split(k), y.tensor_split(k)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = ref(xm, ym)
            (loss / k).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), tau)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    model, opt = _pair()
    state = AmpTrainState(model, opt, dtype="bf16", max_norm=tau, accumulation_steps=k)
    logs = [state.step(x, y) for x, y in data]
    assert [r.grad_l2_pre_clip for r in logs] == ref_norms
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    assert all(math_finite(r.loss) for r in logs)


def math_finite(v):
    return v == v and abs(v) != float("inf")


class OwnLoss(torch.nn.Module):
    """``forward(x, y)`` returns ``wrap(prediction, loss)``; ``forward(input_ids=, labels=)`` for mappings."""

    def __init__(self, wrap):
        super().__init__()
        self.lin, self.wrap = torch.nn.Linear(4, 1), wrap

    def forward(self, x=None, y=None, *, input_ids=None, labels=None):
        x, y = (input_ids, labels) if input_ids is not None else (x, y)
        pred = self.lin(x)
        return self.wrap(pred, F.mse_loss(pred.float(), y))


@pytest.mark.parametrize(
    "wrap",
    [
        lambda p, loss: (p, loss),  # nanoGPT
        lambda p, loss: (loss, p),  # transformers with return_dict=False
        lambda p, loss: {"logits": p, "loss": loss},
        lambda p, loss: SimpleNamespace(logits=p, loss=loss),  # a ModelOutput's attribute
        lambda p, loss: loss,  # forward(x, y) -> the loss alone
    ],
    ids=["logits-loss", "loss-logits", "dict", "attribute", "loss-alone"],
)
@pytest.mark.parametrize("mapping_inputs", [False, True])
def test_each_output_form_trains_and_equals_the_same_loss_through_loss_fn(wrap, mapping_inputs):
    torch.manual_seed(0)
    own, plain = OwnLoss(wrap), torch.nn.Linear(4, 1)
    plain.load_state_dict(own.lin.state_dict())
    s_own = AmpTrainState(own, torch.optim.SGD(own.parameters(), lr=0.1), dtype="fp32", max_norm=0.5)
    s_plain = AmpTrainState(plain, torch.optim.SGD(plain.parameters(), lr=0.1), F.mse_loss, dtype="fp32", max_norm=0.5)
    for _ in range(3):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        a = s_own.step({"input_ids": x} if mapping_inputs else x, y)
        b = s_plain.step(x, y)
        assert (a.loss, a.grad_l2_pre_clip) == (b.loss, b.grad_l2_pre_clip)
    assert torch.equal(own.lin.weight, plain.weight)


@pytest.mark.parametrize(
    "wrap, got",
    [
        (lambda p, loss: p, "a tensor of shape (8, 1)"),
        (lambda p, loss: (p, None), "a tuple of a tensor of shape (8, 1), None"),
        (lambda p, loss: (loss, loss), "a tuple of a tensor of shape (), a tensor of shape ()"),
        (lambda p, loss: {"logits": p}, "a dict with keys 'logits' and no 'loss'"),
        (lambda p, loss: {"logits": p, "loss": None}, "a dict with keys 'logits', 'loss' ('loss' is None)"),
        (lambda p, loss: SimpleNamespace(loss=None), "a SimpleNamespace"),
    ],
)
def test_a_wrong_model_output_is_one_line_naming_the_expected_forms(wrap, got):
    model = OwnLoss(wrap)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype="fp32")
    msg = f"the model computes its own loss (loss_fn=None) but returned {got}: expected {EXPECTED_MODEL_OUTPUT}"
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        state.step(torch.randn(8, 4), torch.randn(8, 1))


@pytest.mark.parametrize("form", ["tuple", "dict", "ModelOutput", "mapping batch"])
def test_a_model_called_without_targets_says_so(form):
    """``state.step(x, None)`` by mistake: the model's loss slot is None (nanoGPT's ``(logits, None)``, a Hugging
    Face output without ``loss``), and the message named the expected forms only, not the missing targets."""
    from transformers.modeling_outputs import CausalLMOutput

    wrap = {
        "tuple": lambda p, loss: (p, loss),
        "dict": lambda p, loss: {"logits": p, "loss": loss},
        "ModelOutput": lambda p, loss: CausalLMOutput(loss=loss, logits=p),
        "mapping batch": lambda p, loss: {"logits": p, "loss": loss},
    }[form]

    class NoTargets(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            p = self.lin(x)
            return wrap(p, None if labels is None else F.mse_loss(p, labels))

    model = NoTargets()
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype="fp32")
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match=r"; it was called without targets \(targets=None\): pass them, state.step"):
        state.step({"x": x} if form == "mapping batch" else x, None)
    assert state.step({"x": x} if form == "mapping batch" else x, torch.randn(8, 1)).step == 1


def test_a_loss_fn_returning_none_names_the_forms_and_loss_fn_none():
    """The obvious adapter for a ``(logits, loss)`` model called without targets gets ``None``."""
    model, opt = _pair()
    state = AmpTrainState(model, opt, lambda out, y: out[1], dtype="bf16")
    x, y = batches(1, batch=4, block=8, vocab=32)[0]
    with pytest.raises(
        ValueError, match=r"^loss_fn returned None: expected a loss tensor or \(loss_sum, token_count\); "
    ):
        state.step(x, y)


def test_per_example_clipping_needs_a_loss_fn():
    model, opt = _pair()
    from clipamp_engine.clip.dpsgd import DPSGDClip

    with pytest.raises(ValueError, match="needs a loss_fn"):
        AmpTrainState(model, opt, dtype="fp32", clip=DPSGDClip(1.0, 0.0))


class HFStyle(torch.nn.Module):
    """``forward(input_ids, labels=None)`` returning ``{"logits", "loss"}``, like a transformers model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def _ids(n=4):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 20, (8, 5), generator=g) for _ in range(n)]


@pytest.mark.parametrize("k", [1, 2])
def test_a_batch_that_holds_its_labels_trains_with_targets_none(k):
    """A collator's batch (``labels`` inside) goes in as ``step(batch, None)``: the same run as ``labels=``."""
    runs = []
    for inside in (False, True):
        model = HFStyle()
        state = AmpTrainState(model, torch.optim.AdamW(model.parameters()), dtype="bf16", accumulation_steps=k)
        for ids in _ids():
            log = state.step({"input_ids": ids, "labels": ids}, None) if inside else state.step({"input_ids": ids}, ids)
        runs.append((log.loss, log.grad_l2_pre_clip, [p.detach().clone() for p in model.parameters()]))
    (loss_a, norm_a, params_a), (loss_b, norm_b, params_b) = runs
    assert (loss_a, norm_a) == (loss_b, norm_b)
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))


def test_labels_in_the_batch_and_targets_too_is_one_line_and_changes_nothing():
    model = HFStyle()
    state = AmpTrainState(model, torch.optim.AdamW(model.parameters()), dtype="bf16")
    before = [p.detach().clone() for p in model.parameters()]
    ids = _ids(1)[0]
    with pytest.raises(ValueError, match=r"^the batch holds 'labels' and targets were given too: pass targets=None"):
        state.step({"input_ids": ids, "labels": ids}, ids)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_model_that_takes_no_targets_needs_a_loss_fn_said_at_construction():
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match=r"Linear.forward takes neither: pass loss_fn \(e.g. torch.nn.functional.mse"):
        AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("k", [1, 2])
def test_a_loss_without_targets_is_the_canonical_loop_bit_for_bit(k):
    """An unsupervised loss (``loss_fn(output, None)``), with accumulation: ``step(inputs, None)``."""
    data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def loss_fn(out, _):
        return out.pow(2).mean()

    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = AmpTrainState(model, opt, loss_fn, dtype="fp32", max_norm=0.1, accumulation_steps=k)
    for x in data:
        for xm in x.tensor_split(k):
            (loss_fn(ref(xm), None) / k).backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)
        assert state.step(x, None).grad_l2_pre_clip == float(norm)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))


def test_a_mapping_batch_with_a_list_of_samples_first_splits_with_its_tensors():
    """``{"texts": [...], "input_ids": tensor}``: the batch size is the list's length, and each micro-batch
    gets its share of the list as ``tensor_split`` gives it its rows."""
    seen = []

    class TextModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, batch):
            seen.append((list(batch["texts"]), batch["x"].shape[0]))
            return self.lin(batch["x"])

    model = TextModel()
    state = AmpTrainState(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, dtype="fp32", accumulation_steps=3
    )
    texts = [f"t{i}" for i in range(7)]
    state.step({"texts": texts, "x": torch.randn(7, 4)}, torch.randn(7, 1))
    assert seen == [(["t0", "t1", "t2"], 3), (["t3", "t4"], 2), (["t5", "t6"], 2)]


@pytest.mark.slow  # builds and trains a transformers model
def test_a_hugging_face_model_takes_tensor_targets_as_labels():
    """``state.step(input_ids, labels)`` on a transformers model: ``model(ids, labels)`` put the labels in its
    second positional parameter (``past_key_values`` for GPT-2: an AttributeError deep inside transformers);
    the step passes ``labels=`` when ``forward`` takes it elsewhere, as the mapping form does. Also through a
    ``torch.compile`` wrapper, whose own forward takes ``*args, **kwargs``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=40, n_positions=16, loss_type="ForCausalLMLoss")
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    ids = torch.randint(0, 40, (4, 8), generator=torch.Generator().manual_seed(0))
    states = []
    for form in ("tensor", "mapping", "compiled"):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        wrapped = torch.compile(model) if form == "compiled" else model
        state = AmpTrainState(wrapped, torch.optim.AdamW(model.parameters(), lr=1e-3), dtype="fp32", max_norm=0.5)
        if form != "compiled":  # compiling takes seconds: its signature is what this checks
            logs = [state.step({"input_ids": ids} if form == "mapping" else ids, ids) for _ in range(2)]
            states.append((logs, model))
        else:
            from clipamp_engine.model_loss import _forward_params, _labels_by_name

            assert _labels_by_name(_forward_params(wrapped))
    (tensor_logs, tensor_model), (mapping_logs, mapping_model) = states
    assert [r.grad_l2_pre_clip for r in tensor_logs] == [r.grad_l2_pre_clip for r in mapping_logs]
    assert all(torch.equal(p, q) for p, q in zip(tensor_model.parameters(), mapping_model.parameters()))


def test_a_wrapped_model_that_takes_no_targets_is_refused_at_construction_too():
    """A ``torch.compile`` wrapper's forward takes ``*args, **kwargs``: the wrapped module's signature decides."""
    model = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match=r"Linear.forward takes neither: pass loss_fn"):
        AmpTrainState(torch.compile(model), torch.optim.SGD(model.parameters(), lr=0.1))
