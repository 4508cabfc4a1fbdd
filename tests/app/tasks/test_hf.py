"""model=hf / data=hf: tokenized batches, the token-mean loss and norm, determinism, tokenizer cache."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from sweep import app
from sweep.config.schema import DataConfig, ModelConfig
from sweep.tasks.build import build_task
from sweep.tasks.hf_model import PAD
from tests.app.helpers import compose_cfg

TINY_LLAMA = dict(
    model_type="llama",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def write_corpus(path: Path, n: int = 400, seed: int = 0) -> Path:
    """A jsonl of documents of very different lengths from two sources (prose, code)."""
    rng = random.Random(seed)
    prose = "the of and to in is was for on that with as by at from it an be this are".split()
    code = "def return import class self if else for in while yield lambda None True".split()
    with open(path, "w") as f:
        for i in range(n):
            src = "code" if i % 3 == 0 else "prose"
            words = code if src == "code" else prose
            text = " ".join(rng.choice(words) for _ in range(rng.randint(2, 60)))
            f.write(json.dumps({"text": text, "source": src, "id": i}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("hf") / "corpus.jsonl")


def hf_task(corpus: Path, seed: int = 0, **data):
    d = dict(
        name="hf",
        files=str(corpus),
        source_field="source",
        vocab_size=300,
        seq_len=32,
        batch_size=8,
        packing=False,
        eval_batches=1,
    )
    d.update(data)
    return build_task(ModelConfig(name="hf", config=dict(TINY_LLAMA)), DataConfig(**d), seed=seed)


def grad_norm(model, loss) -> float:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def test_padded_batches_mask_exactly_the_ignored_targets(corpus):
    b = next(hf_task(corpus).train_batches)
    pad = b.inputs == PAD
    assert pad.any() and (~pad).any()
    assert torch.equal(pad, b.targets == -100)
    assert torch.equal(b.inputs[:, 1:][~pad[:, 1:]], b.targets[:, :-1][~pad[:, 1:]])  # next-token targets
    assert b.data_source in {"prose", "code"}


def test_packed_batches_are_full_windows_of_the_token_stream(corpus):
    task = hf_task(corpus, packing=True)
    b = next(task.train_batches)
    assert (b.targets != -100).all() and (b.inputs >= 0).all()
    assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])


def test_attention_mask_reaches_the_model(corpus):
    """Real positions' logits equal transformers' own forward with the mask; pad ids do not matter."""
    task = hf_task(corpus)
    b = next(task.train_batches)
    real = b.inputs != PAD
    logits = task.model(b.inputs)
    with torch.no_grad():
        ids = b.inputs.masked_fill(~real, 7)  # any pad id
        ref = task.model.forward(input_ids=ids, attention_mask=real.long()).logits  # hooks bypassed
    torch.testing.assert_close(logits[real], ref[real])


def test_same_seed_same_model_and_batches(corpus):
    a, b, c = hf_task(corpus, seed=3), hf_task(corpus, seed=3), hf_task(corpus, seed=4)
    for x, y in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(x, y)
    assert not all(torch.equal(x, y) for x, y in zip(a.model.parameters(), c.model.parameters()))
    for _ in range(3):
        ba, bb, bc = next(a.train_batches), next(b.train_batches), next(c.train_batches)
        assert torch.equal(ba.inputs, bb.inputs) and ba.data_source == bb.data_source
    assert not torch.equal(ba.inputs, bc.inputs)


def test_trained_tokenizer_is_cached_and_lossless(corpus, tmp_path):
    from sweep.tasks import hf_data as D

    d = DataConfig(name="hf", files=str(corpus), vocab_size=300, cache_dir=str(tmp_path))
    docs, _ = D.file_docs(d)
    tok, where = D.trained_tokenizer(d, docs, [corpus])
    stamp = (where / "tokenizer.json").stat().st_mtime_ns
    tok2, where2 = D.trained_tokenizer(d, docs, [corpus])
    assert where2 == where and (where / "tokenizer.json").stat().st_mtime_ns == stamp  # not retrained
    text = docs[5][2]
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level BPE round-trips
    assert len(tok) <= 300 and tok.eos_token == D.EOS


@pytest.mark.slow  # a training run through the runner
def test_runner_uses_the_token_mean_over_the_accumulated_batch(corpus, store):
    """steps.csv's first norm is the token-mean gradient norm (transformers' own loss as reference),
    not the sequence-mean one, over both micro-batches together; N_tok is the real token count."""
    cfg = compose_cfg(
        "+experiment=train",
        "model=hf_llama",
        "data=hf",
        f"data.files={corpus}",
        "data.source_field=source",
        "data.vocab_size=300",
        "data.seq_len=32",
        "data.batch_size=8",
        "data.packing=false",
        "data.eval_batches=1",
        "model.config.max_position_embeddings=128",
        "accumulation_steps=2",
        "amp.dtype=fp32",
        "clip=none",
        "steps=1",
        "progress=false",
        "tracking.plots=false",
        f"tracking.uri={store}",
    )
    result = app.run(cfg, [])
    row = pd.read_csv(result.csv_path).iloc[0]

    task = build_task(cfg.model, cfg.data, seed=cfg.seed)  # the same model and first batch
    b = next(task.train_batches)
    logits = task.model(b.inputs)
    real = b.targets != -100
    token_mean = task.model.loss_function(
        logits=logits, labels=None, vocab_size=logits.size(-1), shift_labels=b.targets
    )
    per_tok = F.cross_entropy(logits.float().transpose(1, 2), b.targets, reduction="none")
    seq_mean = ((per_tok * real).sum(1) / real.sum(1)).mean()
    n_tok, n_seq = grad_norm(task.model, token_mean), grad_norm(task.model, seq_mean)

    assert row["token_count"] == real.sum().item()
    assert row["loss"] == pytest.approx(token_mean.item(), rel=1e-5)
    assert row["grad_l2_pre_clip"] == pytest.approx(n_tok, rel=1e-4)
    assert abs(n_seq / n_tok - 1) > 0.02  # the sequence mean is a different norm on the same batch
    assert row["grad_l2_token_normalised"] == pytest.approx(n_tok * math.sqrt(row["token_count"]), rel=1e-4)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.config.model_type=bertish"], "model.config.model_type='bertish' is not a transformers causal LM"),
        (["model.pretrained=/nonexistent/dir"], "model.pretrained='/nonexistent/dir' does not exist"),
        (["model.pretrained=someorg/somemodel"], "looks like a hub name"),
        (["data.text_field=body"], "data.text_field='body' is not a column"),
        (["model.config.vocab_size=100"], "tokens but the model's embedding has 100 rows"),
        (["model.freeze=[nothing_matches]"], "matches no parameter name"),
        (["+model.config.num_hiden_layers=2"], "did you mean model.config.num_hidden_layers"),
    ],
)
def test_user_errors_name_the_value(corpus, overrides, match):
    from sweep.errors import UserError

    cfg = compose_cfg(
        "+experiment=train", "model=hf_llama", "data=hf", f"data.files={corpus}", "data.vocab_size=300", *overrides
    )
    with pytest.raises(UserError, match=match.replace("(", r"\(").replace(".", r"\.")):
        build_task(cfg.model, cfg.data, seed=0)


def test_a_file_under_the_other_datas_key_is_refused_not_replaced(corpus):
    """``data=hf data.path=FILE`` (data=text's key) used to train on the standard-library corpus
    instead of FILE, saying nothing; ``data.files`` under another data was ignored the same way."""
    from sweep.errors import UserError

    for overrides, said in (
        (
            ["data=hf", f"data.path={corpus}"],
            f"data.path='{corpus}' is read by data=text only, not data=hf: pass data.files={corpus} ",
        ),
        (["data=stdlib", f"data.files={corpus}"], f"data.files='{corpus}' is read by data=hf only, not data=stdlib"),
        (["data=text", f"data.path={corpus}", f"data.files={corpus}"], "' is read by data=hf only, not data=text"),
    ):
        cfg = compose_cfg("+experiment=train", "model=hf_llama", "data.vocab_size=300", "data.max_files=20", *overrides)
        with pytest.raises(UserError) as e:
            build_task(cfg.model, cfg.data, seed=0)
        assert said in str(e.value) and "\n" not in str(e.value)


def test_a_directory_without_a_tokenizer_is_refused_as_such(tmp_path, corpus):
    """``data.tokenizer=`` a model directory saved without its tokenizer: transformers 5 builds its
    config's tokenizer class with an empty vocabulary, every document became nothing and the run said
    "the corpus has 0 usable document(s)". Refused instead, naming the tokenizer directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sweep.errors import UserError

    model_dir, vocabless = tmp_path / "model", tmp_path / "vocabless"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2)).save_pretrained(
        model_dir
    )
    vocabless.mkdir()
    (vocabless / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    for where, said in (
        (model_dir, f"data.tokenizer='{model_dir}' has no tokenizer.json or tokenizer_config.json: pass"),
        (vocabless, f"data.tokenizer='{vocabless}' holds no tokenizer vocabulary (GPT2Tokenizer of"),
    ):
        with pytest.raises(UserError) as e:
            build_task(
                ModelConfig(name="hf", config=dict(TINY_LLAMA)),
                DataConfig(name="hf", files=str(corpus), tokenizer=str(where)),
                seed=0,
            )
        assert said in str(e.value), str(e.value)


def test_not_a_model_dir_and_empty_dataset(tmp_path, corpus):
    from sweep.errors import UserError

    with pytest.raises(UserError, match="is not a model directory"):
        build_task(ModelConfig(name="hf", pretrained=str(tmp_path)), DataConfig(name="hf", files=str(corpus)), seed=0)
    blank, empty = tmp_path / "blank.jsonl", tmp_path / "empty.jsonl"
    blank.write_text(json.dumps({"text": "  ", "source": "a"}) + "\n")
    empty.write_text("")
    for path in (blank, empty):
        with pytest.raises(UserError, match="hold no non-empty 'text' text"):
            hf_task(path)


def test_a_row_without_a_source_is_its_files(tmp_path):
    """``data.source_field`` null in a row: its data_source is the file's name (the documented default), not 'None'."""
    from sweep.tasks import hf_data as D

    path = tmp_path / "mixed.jsonl"
    rows = [{"text": f"document {i}", "source": None if i % 3 == 0 else "web"} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs, skipped = D.file_docs(DataConfig(name="hf", files=str(path), source_field="source"))
    assert skipped == ""
    assert [source for _, source, _ in docs] == ["mixed.jsonl" if i % 3 == 0 else "web" for i in range(6)]


def test_rows_without_text_are_skipped_and_counted(tmp_path, corpus, capfd):
    """Empty, null and non-string text rows are not documents; the run says how many it skipped and
    the first non-string one (a JSON Lines file may mix types), and a file of only lists is refused
    with that row named."""
    from sweep.errors import UserError
    from sweep.tasks import hf_data as D

    path = tmp_path / "mixed.jsonl"
    rows = [json.loads(line) for line in corpus.read_text().splitlines()]
    rows[3]["text"], rows[5]["text"], rows[8]["text"], rows[9]["text"] = None, "", 5, ["a", "b"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs, skipped = D.file_docs(DataConfig(name="hf", files=str(path)))
    assert [name for name, _, _ in docs] == [f"mixed.jsonl#{i}" for i in range(len(rows)) if i not in (3, 5, 8, 9)]
    assert skipped == "4 rows skipped: 2 empty; 2 not strings, first mixed.jsonl#8 holds int 5"
    task = hf_task(path)
    assert "2 not strings" in task.description
    assert "note: data.files: 4 rows skipped: 2 empty; 2 not strings" in capfd.readouterr().err
    lists = tmp_path / "lists.jsonl"
    lists.write_text(json.dumps({"text": ["a b", "c"]}) + "\n" + json.dumps({"text": ["d"]}) + "\n")
    with pytest.raises(UserError, match=r"\(2 rows are not strings; lists.jsonl#0 holds list \['a b', 'c'\]\)"):
        D.file_docs(DataConfig(name="hf", files=str(lists)))


def test_documents_end_with_eos_else_sep_else_nothing_said(corpus, tmp_path, capfd):
    """Packed documents are separated by the tokenizer's EOS, by its SEP when it has no EOS (BERT-style),
    and joined with nothing between them only when it has neither, which the run then says."""
    from sweep.tasks import hf_data as D

    d = DataConfig(name="hf", files=str(corpus), vocab_size=300, cache_dir=str(tmp_path / "bpe"))
    docs, _ = D.file_docs(d)
    docs = docs[:5]
    tok, _ = D.trained_tokenizer(d, docs, [corpus])
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for _, _, t in docs]
    ends = {}
    for kind, special in (("eos", {}), ("sep", {"eos_token": None, "sep_token": D.EOS}), ("none", {"eos_token": None})):
        tok.save_pretrained(tmp_path / kind)
        t = D.load_tokenizer(tmp_path / kind, "data.tokenizer")
        for key, value in special.items():
            setattr(t, key, value)
        ids = D.tokenize(docs, t)
        ends[kind] = [int(ids.data[end - 1]) for end in ids.offsets[1:]]
        assert ids.offsets.diff().tolist() == [n + (kind != "none") for n in lengths]
    eos_id = tok.convert_tokens_to_ids(D.EOS)
    assert ends["eos"] == ends["sep"] == [eos_id] * len(docs) and eos_id not in ends["none"]
    plain = tmp_path / "plain"
    tok.save_pretrained(plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    capfd.readouterr()
    task = hf_task(corpus, packing=True, tokenizer=str(plain))
    assert "packed with no separator (the tokenizer has no eos_token or sep_token)" in task.description
    assert "packed documents are joined with no token between them" in capfd.readouterr().err


def test_records_nested_under_a_key_are_read_with_data_field(tmp_path, corpus):
    """``{"data": [{"text": …}, …]}`` (what datasets reads with ``field="data"``) was unreadable: the run
    said "data.text_field='text' is not a column …: pass data.text_field=NAME", and no NAME works.
    ``data.field=data`` reads the same documents as the JSON Lines file of the same records; without it
    the message names the key; a wrong key or a JSON Lines file is one line naming what to pass."""
    from sweep.errors import UserError
    from sweep.tasks import hf_data as D

    records = [json.loads(line) for line in corpus.read_text().splitlines()]
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"version": 1, "data": records}))
    docs, _ = D.file_docs(DataConfig(name="hf", files=str(nested), field="data", source_field="source"))
    reference, _ = D.file_docs(DataConfig(name="hf", files=str(corpus), source_field="source"))
    assert [d[1:] for d in docs] == [d[1:] for d in reference] and len(docs) == len(records)
    for field, files, said in (
        (None, nested, "its records sit in a list under the key 'data': pass data.field=data"),
        (
            "nope",
            nested,
            "data.field='nope': nested.json has no list of records under that key: its keys are "
            "version, data; pass data.field=data",
        ),
        ("data", corpus, "data.field='data': corpus.jsonl is not one JSON object (JSON Lines has no key"),
    ):
        with pytest.raises(UserError) as e:
            D.file_docs(DataConfig(name="hf", files=str(files), field=field))
        assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(UserError, match="read with data=hf data.files=FILE.json only"):
        build_task(ModelConfig(name="hf", config=dict(TINY_LLAMA)), DataConfig(name="stdlib", field="data"), seed=0)
