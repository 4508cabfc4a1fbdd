"""``model=hf``: a ``transformers`` causal LM on tokenized text (``data=hf`` files, or stdlib/text).

``build_task`` calls ``hf_task`` for ``model=hf`` (this module never imports ``build``).

Batches are token windows: packed (documents back to back, EOS between; every target real) or
padded (one document window per row, input ``PAD`` and target -100 where padded, attention mask
0 there). The loss is the runner's ``lm_loss``: (token-sum, real-token count), so the engine's
step loss is the token mean over every real token of the whole accumulated batch: a mean of
per-sequence means would weigh short sequences up and change the gradient norm.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
from typing import Any

import torch

from ..config.schema import DataConfig, ModelConfig
from ..errors import UserError
from . import corpus as C
from . import hf_data as D
from . import hf_model as M


def _tokenizer(d: DataConfig, m: ModelConfig, docs: list[D.Doc], files: list) -> tuple[Any, str]:
    """(tokenizer, where it came from): data.tokenizer, else model.pretrained's, else a trained BPE."""
    if d.tokenizer:
        return D.load_tokenizer(d.tokenizer, "data.tokenizer"), f"data.tokenizer={d.tokenizer}"
    if m.pretrained:
        p = M.pretrained_dir(m.pretrained)
        if not D.has_tokenizer(p):
            raise UserError(
                f"model.pretrained={m.pretrained!r} has no tokenizer: pass data.tokenizer=DIR, the "
                "tokenizer the model was trained with (a new one would not match its embedding)"
            )
        return D.load_tokenizer(p, "model.pretrained"), "model.pretrained's"
    tok, where = D.trained_tokenizer(d, docs, files)
    return tok, f"BPE {len(tok)} trained on the corpus, cached in {where}"


@functools.lru_cache(maxsize=4)
def _corpora(d_json: str, pretrained: str | None) -> tuple[C.Corpus, C.Corpus, Any, str, int, str]:
    """(train, held-out, tokenizer, where it came from, documents, rows skipped), tokenized once
    per process (sweep trials share them)."""
    d = DataConfig(**json.loads(d_json))
    m = ModelConfig(name="hf", pretrained=pretrained)
    if d.name == "hf" and d.files:
        files, (docs, skipped) = D.resolve_files(d.files), D.file_docs(d)
    else:
        files, docs, skipped = [], D.builtin_docs(d), ""
    tok, where = _tokenizer(d, m, docs, files)
    full = D.tokenize(docs, tok)
    if skipped:
        print(f"note: data.files: {skipped}", file=sys.stderr)
    if d.packing and D.separator(tok) is None:
        print(
            "note: the tokenizer has no eos_token or sep_token: packed documents are joined with no "
            "token between them; pass data.tokenizer=DIR with one, or data.packing=false",
            file=sys.stderr,
        )
    train, held_out = C.split_corpus(
        full,
        float(d.eval_fraction),
        "pass data.files=FILE(S) with more documents (one per line of .txt, one per row otherwise)"
        if d.name == "hf"
        else "pass data.path=FILE with more text",
    )
    T = int(d.seq_len)
    for split, c in (("training", train), ("held-out", held_out)):
        if d.packing and c.nbytes <= T:
            raise UserError(
                f"the {split} split has {c.nbytes} tokens, not more than data.seq_len={T} "
                f"(packing needs one full window): lower data.seq_len, use more text"
                + (", or raise data.eval_fraction" if split == "held-out" else "")
            )
    return train, held_out, tok, where, len(full), skipped


def _batches(corpus: C.Corpus, d: DataConfig, g: torch.Generator, device: torch.device):
    """Endless seeded (inputs, targets, data_source) triples: packed or padded windows."""
    bs, T = int(d.batch_size), int(d.seq_len)
    while True:
        if d.packing:
            x, y, src = C.sample_packed(corpus, bs, T, g)
        else:
            x, y, src = C.sample_windows(corpus, bs, T, g, pad=M.PAD)
        yield x.to(device), y.to(device), src


def hf_task(m: ModelConfig, d: DataConfig, *, seed: int, eval_seed: int, device: torch.device):
    """-> (model initialised from ``seed``, train triples, eval triples, what it trains on, the tokenizer).

    ``build_task`` wraps the triples into batches, freezes parameters and adds the token-mean loss.
    """
    if d.name == "synthetic":
        raise UserError(
            "model=hf needs text, got data.name='synthetic': pass data=hf data.files=FILE (or data=stdlib, data=text)"
        )
    M.precheck(m)  # before the (slower) data
    d_json = json.dumps(dict(vars(d)), sort_keys=True, default=str)
    train, held_out, tok, where, n_docs, skipped = _corpora(d_json, m.pretrained)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = M.build(m, len(tok))
    M.check_fits(model, len(tok), int(d.seq_len), where)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    model = M.adapt(model, pad_id, padded=not d.packing).to(device).train()
    evals = list(
        itertools.islice(_batches(held_out, d, torch.Generator().manual_seed(eval_seed), device), int(d.eval_batches))
    )
    origin = f"model.pretrained={m.pretrained}" if m.pretrained else f"model_type={model.config.model_type}"
    sep = D.separator(tok)
    layout = (
        "padded"
        if not d.packing
        else f"packed, {sep} after each"
        if sep
        else "packed with no separator (the tokenizer has no eos_token or sep_token)"
    )
    about = (
        f"({origin}) on {d.name} ({n_docs} docs{', ' + skipped if skipped else ''}, "
        f"{train.nbytes + held_out.nbytes} tokens, {len(held_out)} docs held out; {layout}; tokenizer: {where})"
    )
    return model, _batches(train, d, torch.Generator().manual_seed(seed), device), evals, about, tok
