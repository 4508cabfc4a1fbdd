"""Issue 12 item 16: a custom model with the wrong output is refused in one line naming the expected output."""

from __future__ import annotations

import pytest

from sweep.config.schema import DataConfig, ModelConfig
from sweep.errors import UserError
from sweep.tasks.build import build_task
from tests.app.helpers import TINY, run_cli

LM = DataConfig(name="stdlib", batch_size=2, seq_len=16, max_files=20, eval_batches=1)
SYN = DataConfig(name="synthetic", batch_size=4, eval_batches=1)

CASES = [
    (
        dict(_target_="torch.nn.Embedding", kwargs={"num_embeddings": 256, "embedding_dim": 8}),
        LM,
        "model._target_='torch.nn.Embedding' returned (2, 16, 8) for inputs of shape (2, 16); "
        "expected logits of shape (batch, seq_len, 256) = (2, 16, 256)",
    ),
    (
        dict(_target_="torch.nn.GRU", kwargs={"input_size": 16, "hidden_size": 1}),
        SYN,
        "model._target_='torch.nn.GRU' returned a tuple for inputs of shape (4, 16); "
        "expected a tensor of shape (batch, model.out_features=1) = (4, 1)",
    ),
    (
        dict(_target_="torch.nn.Linear", kwargs={"in_features": 16, "out_features": 3}),
        SYN,
        "model._target_='torch.nn.Linear' returned (4, 3) for inputs of shape (4, 16); "
        "expected a tensor of shape (batch, model.out_features=1) = (4, 1)",
    ),
    (dict(_target_="torch.nn.Identity"), LM, "model._target_='torch.nn.Identity' has no trainable parameters"),
    (
        dict(_target_="torch.nn.Linear", kwargs={"in_features": 7, "out_features": 1}),
        SYN,
        "model._target_='torch.nn.Linear' failed on inputs of shape (4, 16) (RuntimeError: mat1 and mat2 shapes",
    ),
]


@pytest.mark.parametrize("model,data,message", CASES, ids=["shape", "tuple", "features", "no-params", "forward"])
def test_wrong_output_is_one_line(model, data, message):
    with pytest.raises(UserError) as e:
        build_task(ModelConfig(name="custom", **model), data, seed=0)
    text = str(e.value)
    assert text.startswith(message), text
    assert "\n" not in text and ("make model._target_=" in text or "no trainable" in text)


def test_a_fitting_custom_model_trains_unchanged():
    """The check is an eval-mode forward: the built model and the first training batch equal an unchecked build."""
    import torch

    cfg = ModelConfig(name="custom", _target_="sweep.tasks.models.TinyMLPLM", kwargs={"d": 16, "hidden": 32})
    a = build_task(cfg, LM, seed=3)
    b = build_task(
        ModelConfig(name="custom", _target_="sweep.tasks.models.TinyMLPLM", kwargs={"d": 16, "hidden": 32}), LM, seed=3
    )
    assert a.model.training
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(next(a.train_batches).inputs, next(b.train_batches).inputs)


@pytest.mark.slow  # a `python -m sweep` subprocess: seconds of imports
def test_cli_wrong_output_exit_2_and_no_run(tmp_path, store):
    p = run_cli(
        "+experiment=train",
        "model=custom",
        "data=synthetic",
        "model._target_=torch.nn.GRU",
        "+model.kwargs.input_size=16",
        "+model.kwargs.hidden_size=1",
        "steps=2",
        *TINY,
        cwd=tmp_path,
    )
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: model._target_='torch.nn.GRU' returned a tuple"), p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    from mlflow import MlflowClient

    client = MlflowClient(store)
    assert [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])] == []
