"""Behaviour of the built-in training tasks (sweep.tasks)."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from sweep.config.schema import DataConfig, ModelConfig
from sweep.tasks import corpus as C
from sweep.tasks.build import build_task, evaluate, lm_loss
from tests.app.helpers import CONF

TINY_GPT = dict(name="gpt", d_model=32, n_layer=1, n_head=2, block_size=32)
TINY_LSTM = dict(name="lstm", d_model=32, hidden=64, n_layer=1)


def data(**kw) -> DataConfig:
    return DataConfig(**{"batch_size": 4, "seq_len": 32, "eval_batches": 2, **kw})


def first(task, n=3):
    return [next(task.train_batches) for _ in range(n)]


def overfit(task, steps=30, lr=1e-2):
    batch = next(task.train_batches)
    opt = torch.optim.AdamW(task.model.parameters(), lr=lr)

    def loss():
        out = task.loss_fn(task.model(batch.inputs), batch.targets)
        return out[0] / out[1] if isinstance(out, tuple) else out

    start = loss().item()
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
    return start, loss().item()


# --- determinism ---------------------------------------------------------------------------


@pytest.mark.parametrize("model,dname", [(TINY_GPT, "stdlib"), (dict(name="linear"), "synthetic")])
def test_same_seed_same_batches_different_seed_different(model, dname):
    a, b, c = (first(build_task(ModelConfig(**model), data(name=dname), seed=s)) for s in (7, 7, 8))
    for x, y in zip(a, b):
        assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
        assert x.data_source == y.data_source
    assert any(not torch.equal(x.inputs, z.inputs) for x, z in zip(a, c))


def test_same_seed_same_initial_model():
    m1, m2 = (build_task(ModelConfig(**TINY_GPT), data(), seed=3).model for _ in range(2))
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))


# --- batches -------------------------------------------------------------------------------


def test_padding_is_exactly_the_ignored_targets(tmp_path):
    lengths = [3, 10, 20, 33, 200]  # seq_len 32: windows of at most 33 bytes
    for i, n in enumerate(lengths):
        (tmp_path / f"doc{i}.txt").write_bytes(bytes([65 + i]) * n)
    task = build_task(ModelConfig(**TINY_GPT), data(name="text", path=str(tmp_path), batch_size=8), seed=0)
    for batch in first(task, 5):
        x, y = batch.inputs, batch.targets
        expected = torch.tensor([min(lengths[int(r[0]) - 65], 33) - 1 for r in x])
        valid = y != -100
        assert torch.equal(valid.sum(1), expected)
        assert torch.equal(valid, torch.arange(32) < expected[:, None])  # real bytes first, then padding
        assert (x[~valid] == 0).all() and (x[valid] > 0).all()
        _, count = lm_loss(torch.zeros(*x.shape, 256), y)
        assert isinstance(count, torch.Tensor) and int(count) == int(expected.sum())


def test_targets_are_inputs_shifted_by_one_byte():
    task = build_task(ModelConfig(**TINY_GPT), data(batch_size=16), seed=1)
    docs = C.stdlib_corpus(DataConfig().max_files)
    text = b"\0".join(docs.doc(i) for i in range(len(docs)))
    for batch in first(task, 2):
        x, y = batch.inputs, batch.targets
        both = (y[:, :-1] != -100) & (y[:, 1:] != -100)
        assert torch.equal(x[:, 1:][both], y[:, :-1][both])
        for row_x, row_y in zip(x, y):  # the window is a real slice of a stdlib document
            n = int((row_y != -100).sum())
            window = bytes(row_x[:n].tolist()) + bytes([int(row_y[n - 1])])
            assert window in text


def test_stdlib_documents_are_real_python_sources():
    docs = C.stdlib_corpus(DataConfig().max_files)
    assert len(docs) == DataConfig().max_files
    assert all(n.endswith(".py") for n in docs.names)
    assert not any(part in ("test", "tests", "site-packages") for n in docs.names for part in n.split("/"))
    assert sum("def " in docs.doc(i).decode("utf-8", "replace") for i in range(len(docs))) > len(docs) // 2
    assert all(s == (n.split("/")[0] if "/" in n else n[:-3]) for n, s in zip(docs.names, docs.sources))
    assert len(set(docs.sources)) >= 50  # packages and top-level modules by name
    task = build_task(ModelConfig(**TINY_GPT), data(), seed=0)
    assert all(b.data_source in set(docs.sources) for b in first(task, 5))


def test_text_file_is_chunked_and_named(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("héllo wörld, " * 2000, encoding="utf-8")
    full = C.text_corpus(str(f))
    assert len(full) >= 2 and all(len(full.doc(i)) <= C.CHUNK_BYTES + 1 for i in range(len(full)))
    task = build_task(ModelConfig(**TINY_GPT), data(name="text", path=str(f)), seed=0)
    assert next(task.train_batches).data_source == "corpus.txt"
    assert "corpus.txt" in {b.data_source for b in task.eval_batches}


@pytest.mark.parametrize("source", ["stdlib", "dir"])
def test_eval_split_shares_no_documents_with_train(tmp_path, source):
    if source == "dir":
        for i in range(30):
            (tmp_path / f"f{i}.txt").write_text(f"document {i} " * 20)
        full = C.text_corpus(str(tmp_path))
    else:
        full = C.stdlib_corpus(400)
    train, ev = C.split_corpus(full, 0.05)
    assert len(train) and len(ev) and not set(train.names) & set(ev.names)
    assert sorted(train.names + ev.names) == sorted(full.names)


def test_eval_batches_fixed_across_seeds_and_evaluate_restores_train_mode():
    t1, t2 = (build_task(ModelConfig(**TINY_GPT), data(), seed=s) for s in (1, 2))
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(t1.eval_batches, t2.eval_batches))
    t1.model.eval()
    loss = evaluate(t1)
    assert t1.model.training and math.isfinite(loss) and abs(loss - math.log(256)) < 1.0
    assert abs(evaluate(t1, dtype=torch.bfloat16) - loss) < 0.05


@pytest.mark.parametrize("model", [TINY_GPT, TINY_LSTM])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_models_run_under_cpu_autocast(model, dtype):
    task = build_task(ModelConfig(**model), data(eval_batches=1), seed=0)
    assert math.isfinite(evaluate(task, dtype=dtype))


# --- learning ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,dname",
    [
        (TINY_GPT, "stdlib"),
        (TINY_LSTM, "stdlib"),
        (dict(name="linear"), "synthetic"),
        (dict(name="custom", _target_="sweep.tasks.models.TinyMLPLM", kwargs={"d": 16, "hidden": 64}), "stdlib"),
    ],
)
def test_adamw_overfits_a_fixed_batch(model, dname):
    task = build_task(ModelConfig(**model), data(name=dname), seed=0)
    start, end = overfit(task, lr=3e-2 if model["name"] == "linear" else 1e-2)
    assert end < 0.7 * start, (start, end)


def test_defaults_and_dictconfig_input():
    task = build_task(OmegaConf.structured(ModelConfig), OmegaConf.structured(DataConfig), seed=0)
    assert 0.8e6 <= sum(p.numel() for p in task.model.parameters()) <= 1.0e6
    b = next(task.train_batches)
    assert b.inputs.shape == b.targets.shape == (16, 128) and b.inputs.dtype == torch.int64
    assert task.description.startswith("gpt 0.8")


@pytest.mark.parametrize("group", ["model", "data"])
def test_yaml_nodes_match_the_schema(group):
    schema = OmegaConf.structured(ModelConfig if group == "model" else DataConfig)
    files = sorted((CONF / group).glob("*.yaml"))
    assert files
    for f in files:
        node = OmegaConf.merge(schema, OmegaConf.load(f))  # raises on unknown keys / bad types
        assert f.stem == node.name or f.stem.startswith(f"{node.name}_")  # presets: hf_llama, hf_gpt2


def test_custom_loss_target_is_used():
    task = build_task(
        ModelConfig(name="custom", _target_="sweep.tasks.models.TinyMLPLM", loss_target="sweep.tasks.build.lm_loss"),
        data(),
        seed=0,
    )
    assert task.loss_fn is lm_loss


# --- user errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model,dkw,match",
    [
        (dict(name="foo"), {}, r"model.name='foo' is not one of gpt, lstm, linear, custom"),
        (TINY_GPT, dict(name="wiki"), r"data.name='wiki' is not one of stdlib, text, synthetic"),
        (TINY_GPT, dict(name="text"), r"data.path is not set.*pass data.path=FILE"),
        (
            TINY_GPT,
            dict(name="text", path="/no/such/file.txt"),
            r"data.path='/no/such/file.txt' does not exist: pass data.path=FILE",
        ),
        (TINY_GPT, dict(seq_len=64), r"data.seq_len=64 exceeds model.block_size=32"),
        (dict(name="custom"), {}, r"model._target_ is not set.*model._target_="),
        (
            dict(name="custom", _target_="a.b.C"),
            {},
            r"model._target_='a.b.C' could not be imported: ModuleNotFoundError",
        ),
        (dict(name="custom", _target_="torch.nn.Lineer"), {}, r"could not be imported: AttributeError"),
        (
            dict(name="custom", _target_="sweep.tasks.models.TinyMLPLM", loss_target="x.y"),
            {},
            r"model.loss_target='x.y' could not be imported",
        ),
        (dict(name="custom", _target_="sweep.tasks.models.TinyMLPLM", kwargs={"bogus": 1}), {}, r"model.kwargs"),
        (dict(name="linear"), {}, r"model=linear needs data=synthetic.*pass data=synthetic"),
        (TINY_GPT, dict(name="synthetic"), r"model=gpt needs byte data.*pass data=stdlib"),
        (dict(name="lstm"), dict(name="synthetic"), r"model=lstm needs byte data"),
        (dict(name="gpt", d_model=30, n_head=4), {}, r"model.d_model=30 is not divisible by model.n_head=4"),
        (TINY_GPT, dict(batch_size=0), r"data.batch_size=0 must be a positive integer"),
        (TINY_GPT, dict(path="my.txt"), r"data.path='my.txt' is read by data=text only, not data=stdlib"),
        (TINY_GPT, dict(files="my.jsonl"), r"data.files='my.jsonl' is read by data=hf only, not data=stdlib"),
        ({**TINY_GPT, "pretrained": "ft"}, {}, r"^model.pretrained is for model=hf, not model=gpt \(which would"),
        (dict(name="lstm", config={"hidden_size": 64}), {}, r"^model.config is for model=hf, not model=lstm"),
        (TINY_GPT, dict(tokenizer="tok", cache_dir="c"), r"^data.tokenizer, data.cache_dir are for model=hf, not"),
    ],
)
def test_user_errors_are_one_line_value_errors(model, dkw, match):
    with pytest.raises(ValueError, match=match) as e:
        build_task(ModelConfig(**model), data(**dkw), seed=0)
    assert "\n" not in str(e.value)


def test_empty_text_file_and_empty_directory(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"data.path='.*empty.txt' is empty"):
        build_task(ModelConfig(**TINY_GPT), data(name="text", path=str(empty)), seed=0)
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match=r"contains no non-empty files"):
        build_task(ModelConfig(**TINY_GPT), data(name="text", path=str(tmp_path / "sub")), seed=0)
