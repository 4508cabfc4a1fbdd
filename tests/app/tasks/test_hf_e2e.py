"""model=hf end to end: calibrate from the CLI on a jsonl, fine-tune a saved model with frozen
modules, a sweep over both dtypes, one-line errors."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from sweep import app
from sweep.run.pipeline import RunHooks, RunSpec, run_training
from sweep.tasks.build import build_task
from sweep.tracking.tracker import Store
from tests.app.helpers import compose_cfg, run_cli, run_cli_here

from .test_hf import TINY_LLAMA, grad_norm, write_corpus

pytestmark = pytest.mark.slow

HF_TINY = [
    "data.vocab_size=300",
    "data.seq_len=32",
    "data.batch_size=8",
    "data.eval_batches=1",
    "model.config.max_position_embeddings=128",
    "progress=false",
    "tracking.plots=false",
]


def test_calibrate_cli_on_a_jsonl_with_sources(tmp_path, store):  # the default store, migrated already
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    r = run_cli(
        "+experiment=calibrate",
        "model=hf_llama",
        "data=hf",
        f"data.files={corpus}",
        "data.source_field=source",
        "steps=24",
        "calibrate.window=12",
        "calibrate.start=0",
        "calibrate.quantile=0.95",
        *HF_TINY,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
    m = run.data.metrics
    for key in (
        "grad_norm_p50",
        "grad_norm_p95",
        "grad_norm_p99",
        "recommended_max_norm",
        "clip_ratio",
        "skip_ratio",
        "final_loss",
        "eval_loss",
    ):
        assert math.isfinite(m[key]), key
    assert run.data.params["model.name"] == "hf" and "LlamaForCausalLM" in run.data.tags["task"]
    assert {"steps.csv", "quantiles.json", "report.md"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    df = pd.read_csv(client.download_artifacts(run.info.run_id, "steps.csv", str(tmp_path)))
    assert df["step"].tolist() == list(range(1, 25))
    assert set(df["data_source"]) <= {"prose", "code"} and len(set(df["data_source"])) == 2
    assert (df["token_count"] == 8 * 32).all()  # packed: every target is a real token
    assert m["recommended_max_norm"] == pytest.approx(df["grad_l2_pre_clip"][:12].quantile(0.95), rel=1e-6)
    (cached,) = (tmp_path / ".clipamp").glob("tokenizer-bpe300-*")  # trained once, cached beside the data
    assert f"cached in {cached}" in run.data.tags["task"]  # the tokenizer the run encoded its data with

    from transformers import PreTrainedTokenizerFast

    logged = PreTrainedTokenizerFast.from_pretrained(
        client.download_artifacts(run.info.run_id, "tokenizer", str(tmp_path / "dl"))
    )
    used = PreTrainedTokenizerFast.from_pretrained(cached)
    lines = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    assert logged(lines)["input_ids"] == used(lines)["input_ids"]  # the artifact encodes the data as the run did
    assert (len(logged), logged.eos_token_id, logged.pad_token_id) == (len(used), used.eos_token_id, used.pad_token_id)


def test_finetune_from_save_pretrained_with_frozen_modules(tmp_path, store):
    """A saved tiny Llama + its tokenizer; model.pretrained= with the embedding and layer 0 frozen:
    the run starts from the saved weights, frozen parameters never change and never appear in the
    norms or the forensic columns."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sweep.config.schema import DataConfig
    from sweep.tasks import hf_data as D

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    d = DataConfig(name="hf", files=str(corpus), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    tok, _ = D.trained_tokenizer(d, D.file_docs(d)[0], [corpus])
    torch.manual_seed(123)
    cfg_kw = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    saved = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=len(tok), **cfg_kw))
    saved.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")

    frozen_rx = ["embed_tokens", r"layers\.0\."]
    cfg = compose_cfg(
        "+experiment=calibrate",
        "model=hf",
        f"model.pretrained={tmp_path / 'model'}",
        f"model.freeze=[{','.join(frozen_rx)}]",
        "data=hf",
        f"data.files={corpus}",
        "data.packing=false",
        "amp.dtype=fp32",
        "steps=12",
        "calibrate.window=6",
        "calibrate.start=0",
        "calibrate.quantile=0.95",
        "forensics.top_k=100",
        "forensics.zero_grads=true",
        "forensics.param_norm=true",
        f"tracking.uri={store}",
        *HF_TINY,
    )
    task = build_task(cfg.model, cfg.data, seed=cfg.seed)
    model = task.model
    for (name, p), (_, q) in zip(model.named_parameters(), saved.named_parameters()):
        assert torch.equal(p, q), name  # starts from the saved weights
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(("embed_tokens" in n or ".layers.0." in n) for n in frozen)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    probe = build_task(cfg.model, cfg.data, seed=cfg.seed)  # the same model and first batch
    b = next(probe.train_batches)
    expected = grad_norm(probe.model, probe.loss_fn(probe.model(b.inputs), b.targets)[0] / (b.targets != -100).sum())

    result = run_training(
        cfg, Store.open(store, "clipamp"), RunSpec("ft", task=task), RunHooks(announce=lambda s: None)
    )
    df = pd.read_csv(result.csv_path)
    assert df["grad_l2_pre_clip"][0] == pytest.approx(expected, rel=1e-4)  # trainable parameters only
    listed = {item.split(":")[0] for cell in df["top_grad_params"] for item in cell.split(";")}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert listed == trainable  # top-100 lists every trainable parameter and no frozen one
    assert (df["zero_grad_count"] == 0).all()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (n in frozen), n
    total = math.sqrt(
        sum(p.detach().float().pow(2).sum().item() for n, p in model.named_parameters() if n in trainable)
    )
    assert df["param_norm"].iloc[-1] == pytest.approx(total, rel=1e-4)


def test_sweep_runs_both_dtypes(tmp_path, store):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    cfg = compose_cfg(
        "+experiment=sweep",
        "model=hf_llama",
        "data=hf",
        f"data.files={corpus}",
        "steps=10",
        "calibrate.window=5",
        "study.n_trials=2",
        f"tracking.uri={store}",
        f"study.storage=sqlite:///{tmp_path}/optuna.db",
        *HF_TINY,
    )
    result = app.run(cfg, [])
    done = result.trials[result.trials["state"] == "COMPLETE"]
    assert sorted(done["dtype"]) == ["bf16", "fp16"]
    client = MlflowClient(store)
    for _, trial in done.iterrows():
        df = pd.read_csv(client.download_artifacts(trial["run_id"], "steps.csv", str(tmp_path / trial["dtype"])))
        assert len(df) == 10 and df["loss"].notna().all()
        assert (df["scaler_scale"] > 1).all() == (trial["dtype"] == "fp16")  # fp16 ran with the loss scaler


def test_cli_errors_are_one_line_exit_2(tmp_path, store, capsys, monkeypatch):
    """Through the CLI's entry point in this process (``run_cli_here``: no interpreter start-up); the store
    is made already (the refusal comes after it opens)."""
    here = {"capsys": capsys, "monkeypatch": monkeypatch}
    r = run_cli_here("+experiment=calibrate", "model=hf", "model.config.model_type=nope", cwd=tmp_path, **here)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: model.config.model_type='nope' is not a")
    assert "Traceback" not in r.stderr


def test_spike_runs_its_fp16_pair_on_the_model_config_shrunk_model(tmp_path, store):
    """+experiment=spike model=hf with the fp16 overrides the refusal names: every arm finishes, the fp16
    pair trains the shrunk model (the others the preset) and survives the overflow at the spike."""
    from sweep.config.validate_spike import HF_FP16_EXAMPLE

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    cfg = compose_cfg(
        "+experiment=spike",
        "model=hf",
        "data=hf",
        f"data.files={corpus}",
        "steps=32",
        "spike.at_step=12",
        "spike.horizons=[1,5,20]",
        "calibrate.window=10",
        "calibrate.every=0",
        "spike.peak_window=10",
        HF_FP16_EXAMPLE.strip("'"),
        "amp.dtype=fp32",  # the six preset arms: bf16 autocast on a CPU is several times slower than fp32
        f"tracking.uri={store}",
        *HF_TINY,
        "data.batch_size=4",
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: intra-op threads only wait on a busy 2-core box
    try:
        result = app.run(cfg, [])
    finally:
        torch.set_num_threads(threads)
    widths = {name: arm.task.model.config.hidden_size for name, arm in result.arms.items()}
    assert widths == {
        **{n: 128 for n in ("reference", "calibrated", "none-reference", "none", "fixed-reference", "fixed")},
        "fp16-reference": 32,
        "fp16-calibrated": 32,
    }
    arm = result.fp16["calibrated"][1]
    assert arm.task.model.config.num_hidden_layers == 2 and arm.family == "fp16"
    assert result.fp16_ok is True
    df = pd.read_csv(arm.result.csv_path)
    assert df.loc[df["step"] == 12, "skip_reason"].item() == "nonfinite_grad"  # the spike overflowed fp16: skipped
    client = MlflowClient(store)
    assert {client.get_run(a.result.run_id).info.status for a in result.arms.values()} == {"FINISHED"}
