"""``build_task``: config -> model, loss, seeded batch streams; ``evaluate``.

Users' mistakes raise ``UserError`` (a ``ValueError``) with one line naming the bad value, the
allowed set and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from ..config.schema import DATA_NAMES, MODEL_NAMES, DataConfig, ModelConfig
from ..errors import UserError
from . import corpus as C
from .custom import build_custom, check_custom_output
from .models import GPT, LSTMLM, VOCAB

EVAL_SEED = 0x5EED  # eval batches are the same for every trial seed


@dataclass
class Batch:
    inputs: torch.Tensor  # LM: int64 [B, T] byte ids (0-padded); linear: float [B, in_features]
    targets: torch.Tensor  # LM: int64 [B, T], -100 where padded; linear: float [B, out_features]
    data_source: str  # dominant top-level package / file name; "synthetic" for linear


@dataclass
class Task:
    model: nn.Module
    loss_fn: Callable  # LM: (output, targets) -> (loss_sum, token_count); regression: mean loss
    train_batches: Iterator[Batch]  # infinite; same seed => same sequence
    eval_batches: list[Batch]  # fixed held-out batches
    description: str
    tokenizer: Any = None  # model=hf: the tokenizer the batches were encoded with (logged with the run)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed byte cross-entropy (fp32) and the count of non-padded targets; no host sync."""
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=C.IGNORE, reduction="sum"
    )
    return loss, (targets != C.IGNORE).sum()


def mse_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), targets.float())


def _plain(x: Any) -> Any:
    return OmegaConf.to_container(x, resolve=True) if OmegaConf.is_config(x) else x


def _as(schema: type, cfg: Any) -> Any:
    """Copy ``cfg`` (dataclass or DictConfig) into ``schema``; missing keys take its defaults."""
    if isinstance(cfg, schema):
        return cfg
    out = schema()
    for f in dataclasses.fields(schema):
        if getattr(cfg, f.name, None) is not None or f.name in ("_target_", "loss_target", "path"):
            setattr(out, f.name, _plain(getattr(cfg, f.name, getattr(out, f.name))))
    return out


def _check_data_cfg(d: DataConfig) -> None:
    for key in ("batch_size", "seq_len", "eval_batches") + (("max_files",) if d.name == "stdlib" else ()):
        v = getattr(d, key)
        if not isinstance(v, int) or v < 1:
            raise UserError(f"data.{key}={v!r} must be a positive integer: pass e.g. data.{key}=16")
    ef = d.eval_fraction
    if not 0.0 < float(ef) < 1.0:
        raise UserError(f"data.eval_fraction={ef!r} is not in (0, 1): pass e.g. data.eval_fraction=0.05")
    # a file named under the other data's key would be ignored: the run trains on something else
    if d.path is not None and d.name != "text":
        fix = f"data.files={d.path} (data=hf reads its files there)" if d.name == "hf" else "data=text, or drop it"
        raise UserError(f"data.path={d.path!r} is read by data=text only, not data={d.name}: pass {fix}")
    if d.files and d.name != "hf":
        raise UserError(
            f"data.files={d.files!r} is read by data=hf only, not data={d.name}: pass data=hf (with model=hf), "
            "or data=text data.path=FILE"
        )
    if d.field is not None and not (d.name == "hf" and d.files):
        raise UserError(
            f"data.field={d.field!r} (the key a JSON file's records sit under) is read with data=hf "
            "data.files=FILE.json only: pass data.files, or drop data.field"
        )


def _build_model(m: ModelConfig, seq_len: int) -> tuple[nn.Module, Callable | None]:
    """-> (model, loss_fn or None for the data's default loss)."""
    name = m.name
    if name == "gpt":
        if seq_len > m.block_size:
            raise UserError(
                f"data.seq_len={seq_len} exceeds model.block_size={m.block_size}: "
                f"set data.seq_len<={m.block_size} or model.block_size>={seq_len}"
            )
        if m.n_head < 1 or m.d_model % m.n_head:
            raise UserError(
                f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}: "
                "pick model.n_head dividing model.d_model (e.g. model.n_head=4)"
            )
        return GPT(m.d_model, m.n_layer, m.n_head, m.block_size, m.dropout, m.attention), lm_loss
    if name == "lstm":
        return LSTMLM(m.d_model, m.hidden, m.n_layer, m.dropout), lm_loss
    if name == "linear":
        return nn.Linear(m.in_features, m.out_features), mse_loss
    return build_custom(m)


def freeze(model: nn.Module, m: ModelConfig) -> None:
    """``model.train_only`` / ``model.freeze`` name regexes -> ``requires_grad`` (frozen: never optimised,
    never in a norm). A pattern that matches nothing, or a model left with nothing to train, is refused."""
    import re

    if not m.train_only and not m.freeze:
        return  # the model's own requires_grad flags stand
    from .own_loss import OwnLossModel

    model = model.model if isinstance(model, OwnLossModel) else model  # the user's names, not the wrapper's
    names = [n for n, _ in model.named_parameters()]

    def patterns(key: str) -> list[re.Pattern]:
        out = []
        for pat in getattr(m, key) or []:
            try:
                rx = re.compile(str(pat))
            except re.error as e:
                raise UserError(f"model.{key} pattern {pat!r} is not a regex ({e}): fix it") from None
            if not any(rx.search(n) for n in names):
                raise UserError(
                    f"model.{key} pattern {pat!r} matches no parameter name; names look like "
                    f"{', '.join(names[:3])}: fix the pattern"
                )
            out.append(rx)
        return out

    keep, drop = patterns("train_only"), patterns("freeze")
    for name, p in model.named_parameters():
        p.requires_grad_((not keep or any(rx.search(name) for rx in keep)) and not any(rx.search(name) for rx in drop))
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError("model.freeze/model.train_only leave no parameter to train: loosen the patterns")


def _check_names(mname: str, dname: str) -> None:
    """The model and data choices exist and fit together (``hf`` data only for ``model=hf``)."""
    if mname not in MODEL_NAMES:
        raise UserError(
            f"model.name={mname!r} is not one of {', '.join(MODEL_NAMES)}: pass model=gpt (or lstm, linear, custom, hf)"
        )
    if dname not in DATA_NAMES:
        raise UserError(
            f"data.name={dname!r} is not one of {', '.join(DATA_NAMES)}: pass data=stdlib (or text, synthetic, hf)"
        )
    if mname == "hf":
        return
    if dname == "hf":
        raise UserError(
            f"data=hf is tokenized text for model=hf, got model.name={mname!r}: pass model=hf, or "
            "data=text data.path=FILE for a byte-level model"
        )
    if mname == "linear" and dname != "synthetic":
        raise UserError(f"model=linear needs data=synthetic, got data.name={dname!r}: pass data=synthetic")
    if mname in ("gpt", "lstm") and dname == "synthetic":
        raise UserError(
            f"model={mname} needs byte data, got data.name='synthetic': pass data=stdlib (or data=text data.path=FILE)"
        )


def _check_hf_keys(m: ModelConfig, d: DataConfig) -> None:
    """model=hf's own keys under another model would be ignored: a byte-level model trained from scratch."""
    given = [f"model.{k}" for k in ("pretrained", "config") if getattr(m, k) and m.name in ("gpt", "lstm", "linear")]
    given += [f"data.{k}" for k in ("tokenizer", "cache_dir") if getattr(d, k) and m.name != "hf"]
    if given:
        raise UserError(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for model=hf, not model={m.name} (which "
            f"would ignore {'it' if len(given) == 1 else 'them'}): pass model=hf (or hf_llama, hf_gpt2), or drop "
            f"{'it' if len(given) == 1 else 'them'}"
        )


def build_task(model_cfg: Any, data_cfg: Any, *, seed: int, device: str | torch.device = "cpu") -> Task:
    """Build the model (initialised from ``seed``), its loss and seeded train/eval batches."""
    model_cfg, data_cfg = _as(ModelConfig, model_cfg), _as(DataConfig, data_cfg)
    mname, dname = model_cfg.name, data_cfg.name
    _check_names(mname, dname)
    _check_data_cfg(data_cfg)
    _check_hf_keys(model_cfg, data_cfg)
    if mname == "hf":
        from .hf import hf_task
        from .hf_model import describe

        model, train, evals, about, tok = hf_task(
            model_cfg, data_cfg, seed=seed, eval_seed=EVAL_SEED, device=torch.device(device)
        )
        freeze(model, model_cfg)
        return Task(
            model,
            lm_loss,
            (Batch(*b) for b in train),
            [Batch(*b) for b in evals],
            f"hf {describe(model)} {about}",
            tokenizer=tok,
        )
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, loss_fn = _build_model(model_cfg, int(data_cfg.seq_len))
    model = model.to(device).train()
    freeze(model, model_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    bs, T = int(data_cfg.batch_size), int(data_cfg.seq_len)

    if dname == "synthetic":
        ins, outs = model_cfg.in_features, model_cfg.out_features
        g = torch.Generator().manual_seed(seed)
        w_star = torch.randn(ins, outs, generator=g)
        ge = torch.Generator().manual_seed(seed + EVAL_SEED)
        eval_batches = [_synthetic(w_star, bs, ge, device) for _ in range(data_cfg.eval_batches)]
        train = (_synthetic(w_star, bs, g, device) for _ in itertools.count())
        where = f"synthetic y = x @ W* + 0.1 noise ({ins}->{outs})"
        task = Task(
            model, loss_fn or mse_loss, train, eval_batches, f"{mname} {count_text(n_params)} params on {where}"
        )
        if mname == "custom":
            check_custom_output(
                model,
                task.loss_fn,
                eval_batches[0],
                model_cfg,
                expected=f"a tensor of shape (batch, model.out_features={outs})",
            )
        return task

    full = C.stdlib_corpus(int(data_cfg.max_files)) if dname == "stdlib" else C.text_corpus(data_cfg.path)
    train_c, eval_c = C.split_corpus(full, float(data_cfg.eval_fraction))
    ge = torch.Generator().manual_seed(EVAL_SEED)
    eval_batches = [_lm_batch(eval_c, bs, T, ge, device) for _ in range(data_cfg.eval_batches)]
    g = torch.Generator().manual_seed(seed)
    train = (_lm_batch(train_c, bs, T, g, device) for _ in itertools.count())
    desc = (
        f"{mname} {count_text(n_params)} params on {dname} ({len(full)} docs, {_fmt_bytes(full.nbytes)}; "
        f"{len(eval_c)} held out)"
    )
    task = Task(model, loss_fn or lm_loss, train, eval_batches, desc)
    if mname == "custom":
        check_custom_output(
            model, task.loss_fn, eval_batches[0], model_cfg, expected=f"logits of shape (batch, seq_len, {VOCAB})"
        )
    return task


def _lm_batch(corpus: C.Corpus, bs: int, T: int, g: torch.Generator, device: torch.device) -> Batch:
    x, y, src = C.sample_windows(corpus, bs, T, g)
    return Batch(x.to(device), y.to(device), src)


def _synthetic(w_star: torch.Tensor, bs: int, g: torch.Generator, device: torch.device) -> Batch:
    x = torch.randn(bs, w_star.size(0), generator=g)
    y = x @ w_star + 0.1 * torch.randn(bs, w_star.size(1), generator=g)
    return Batch(x.to(device), y.to(device), "synthetic")


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def count_text(n: int) -> str:
    """A parameter count: ``0.84M`` from 10,000 up, else the number."""
    return f"{n / 1e6:.2f}M" if n >= 10_000 else str(n)


@torch.no_grad()
def evaluate(task: Task, *, dtype: torch.dtype | None = None) -> float:
    """Token-mean (LM) or batch-mean (regression) loss over ``task.eval_batches``."""
    model = task.model
    p = next(model.parameters(), None)
    device_type = p.device.type if p is not None else "cpu"
    model.eval()
    total = count = None
    try:
        amp = torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with amp:
            for b in task.eval_batches:
                out = task.loss_fn(model(b.inputs), b.targets)
                s, n = out if isinstance(out, tuple) else (out.float(), torch.ones((), device=out.device))
                total = s.float() if total is None else total + s.float()
                count = n if count is None else count + n
    finally:
        model.train()
    if total is None:
        return float("nan")
    return (total / count.clamp(min=1)).item()
