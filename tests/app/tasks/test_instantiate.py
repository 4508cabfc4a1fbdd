"""``model=custom`` goes through ``hydra.utils.instantiate``: keys added with ``+model.KEY=`` reach
the constructor, nested ``_target_`` nodes are built (a ``transformers`` config inside its model,
built from the config, never downloaded), ``_args_`` and ``_partial_`` work as in Hydra; each model
equals the one built by hand from the same seed, and every failure is one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sweep.errors import UserError
from sweep.tasks.build import build_task, lm_loss
from sweep.tasks.models import VOCAB, TinyMLPLM
from tests.app.helpers import TINY, compose_cfg

TINY_DATA = [t for t in TINY if t.startswith("data.")]


class FactoryLM(nn.Module):
    """A byte LM taking a factory (``_partial_``) for its activation."""

    def __init__(self, d: int, activation) -> None:
        super().__init__()
        self.emb, self.act, self.out = nn.Embedding(VOCAB, d), activation(), nn.Linear(d, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.emb(x)))


def build(*overrides: str):
    cfg = compose_cfg("+experiment=train", "model=custom", *TINY_DATA, *overrides)
    return cfg, build_task(cfg.model, cfg.data, seed=cfg.seed)


def reference(factory):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return factory()


def assert_same_model(model: nn.Module, ref: nn.Module) -> None:
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)


def test_added_keys_reach_the_constructor_and_the_params():
    cfg, task = build("+model.d=24", "+model.context=3")
    assert cfg.model.kwargs == {"d": 24, "context": 3}  # logged as model.kwargs.d, checked on resume
    assert_same_model(task.model, reference(lambda: TinyMLPLM(d=24, context=3)))


def test_added_keys_are_refused_for_a_builtin_model():
    with pytest.raises(UserError, match=r"^model\.d is not a key of model=gpt .*model=custom") as e:
        compose_cfg("+experiment=train", "+model.d=64")
    assert "\n" not in str(e.value)


def test_an_added_key_and_the_same_kwarg_are_refused():
    with pytest.raises(UserError, match="model.d and model.kwargs.d are both set"):
        compose_cfg("+experiment=train", "model=custom", "+model.d=8", "+model.kwargs.d=16")


def test_nested_target_builds_a_transformers_config_inside_its_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = dict(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    cfg, task = build(
        "model._target_=transformers.GPT2LMHeadModel",
        "+model.config={_target_: transformers.GPT2Config, vocab_size: 256, n_embd: 16, n_layer: 1, "
        "n_head: 2, n_positions: 32}",
    )
    assert isinstance(task.model, GPT2LMHeadModel) and task.model.config.n_embd == 16
    ref = reference(lambda: GPT2LMHeadModel(GPT2Config(**sizes)))
    assert_same_model(task.model, ref)
    b = task.eval_batches[0]
    task.model.eval(), ref.eval()
    with torch.no_grad():  # the runner sees logits (as for model=hf); the loss is the reference's
        loss, count = task.loss_fn(task.model(b.inputs), b.targets)
        ref_loss, ref_count = lm_loss(ref(b.inputs).logits, b.targets)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(count, ref_count)


def test_args_and_partial_work_as_in_hydra():
    _, seq = build(
        "model._target_=torch.nn.Sequential",
        "+model._args_=[{_target_: torch.nn.Embedding, num_embeddings: 256, embedding_dim: 8}, "
        "{_target_: torch.nn.Linear, in_features: 8, out_features: 256}]",
    )
    assert_same_model(seq.model, reference(lambda: nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 256))))

    _, fac = build(
        f"model._target_={__name__}.FactoryLM",
        "+model.d=8",
        "+model.activation={_target_: torch.nn.LeakyReLU, _partial_: true, negative_slope: 0.3}",
    )
    assert isinstance(fac.model.act, nn.LeakyReLU) and fac.model.act.negative_slope == 0.3
    assert_same_model(fac.model, reference(lambda: FactoryLM(8, lambda: nn.LeakyReLU(0.3))))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            ["model._target_=transformers.GPT2LMHeadModel", "+model.config={_target_: transformers.GPT2Confg}"],
            r"model._target_='transformers.GPT2LMHeadModel' failed .*Error locating target 'transformers.GPT2Confg'.*"
            r"full_key: config .*fix model.kwargs",
        ),
        (
            ["+model.bogus=1"],
            r"model._target_='sweep.tasks.models.TinyMLPLM' failed with model.kwargs=\{'bogus': 1\}: "
            r".*unexpected keyword argument 'bogus'",
        ),
        (["+model._partial_=true"], r"model._partial_=true would make the model a factory, not an nn.Module"),
        (["model.pretrained=/some/dir"], r"model.pretrained='/some/dir' is for model=hf"),
    ],
)
def test_failures_are_one_line(overrides, match):
    with pytest.raises(UserError, match=match) as e:
        build(*overrides)
    assert "\n" not in str(e.value) and "HYDRA_FULL_ERROR" not in str(e.value)
