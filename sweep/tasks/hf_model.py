"""``model=hf``: any ``transformers`` causal LM, from a config in YAML or a local pretrained directory.

The model stays the genuine ``transformers`` module (its parameter names, ``save_pretrained``);
two hooks adapt its call to the runner's ``model(ids) -> logits``:

- before ``forward``: ids equal to ``PAD`` (-1, padded positions) become the tokenizer's pad id
  with ``attention_mask`` 0 there (only for padded data: packed batches have no padding and pass
  no mask); ``use_cache=False``;
- after ``forward``: the output's ``logits``, so the loss is the runner's own token-sum/count.

Weights load in fp32 (master weights); autocast gives bf16/fp16 compute like every other model.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from pathlib import Path

import torch
from torch import nn

from ..config.schema import ModelConfig
from ..errors import UserError, one_line
from .hf_data import offline

PAD = -1  # input id of a padded position (targets there are -100)
_EXAMPLES = ("gpt2", "llama", "mistral", "qwen2", "gemma", "phi", "gpt_neox", "opt")


#: Names of one size in different config classes: a key the new ``model_type`` lacks is refused
#: naming its own spelling of it (e.g. the Llama preset's intermediate_size is OPT's ffn_dim).
_SAME_SIZE = (
    ("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "inner_hidden_size"),
    ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    ("hidden_size", "n_embd", "d_model", "dim", "embed_dim"),
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    ("num_attention_heads", "n_head", "num_heads", "n_heads"),
    ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
)
#: Keys ``PreTrainedConfig`` consumes without a field of that name (``__post_init__``).
_CONSUMED = {"torch_dtype", "num_labels", "output_attentions", "attn_implementation", "experts_implementation"}


def _known_keys(config_class: type) -> set[str]:
    known = {f.name for f in fields(config_class)} | set(getattr(config_class, "attribute_map", {})) | _CONSUMED
    known |= {k for k in dir(config_class) if not k.startswith("_")}  # properties (num_labels, rope_scaling...)
    if "rope_parameters" in known:  # legacy RoPE keys, converted into rope_parameters
        known |= {"rope_theta", "rope_scaling"}
    return known


def check_keys(model_type: str, config: dict) -> None:
    """Refuse a ``model.config`` key that ``model_type``'s config class does not have: transformers
    keeps it as an unused attribute and builds its own default instead (a preset's Llama keys under
    another model_type made a model of another size, silently). A near-miss is named as a typo."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    if not is_dataclass(config_class):
        return
    known, name = _known_keys(config_class), config_class.__name__
    unknown = [k for k in config if k not in known and k != "model_type"]
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if close:
            raise UserError(f"model.config.{key} is not a field of {name}: did you mean model.config.{close[0]}?")
    if not unknown:
        return
    them = "it" if len(unknown) == 1 else "them"
    own = []
    for key in unknown:
        same = next((g for g in _SAME_SIZE if key in g), ())
        if mine := next((n for n in same if n in known and n not in config), None):
            own.append(f"+model.config.{mine}={config[key]}")
    raise UserError(
        f"model.config.model_type={model_type} ({name}) has no {', '.join('model.config.' + k for k in unknown)}: "
        f"transformers would ignore {them} and build {name}'s default{'s' if len(unknown) > 1 else ''} instead, "
        f"not the model model.config describes; drop {them}: {' '.join('~model.config.' + k for k in unknown)}"
        + (f", and pass {name}'s own name for the same size: {' '.join(own)}" if own else "")
    )


def from_config(m: ModelConfig, vocab_size: int) -> nn.Module:
    """A randomly initialised causal LM from ``model.config`` (``model_type`` + config keys)."""
    offline()
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(m.config or {})
    model_type = kwargs.pop("model_type", None)
    if kwargs.get("vocab_size") is None:
        kwargs["vocab_size"] = vocab_size
    kwargs["use_cache"] = False
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
    except Exception as e:
        raise UserError(
            f"model.config={ {'model_type': model_type, **kwargs} } is refused by transformers: "
            f"{one_line(e, 300)}: fix that model.config key"
        ) from None
    try:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as e:
        raise UserError(
            f"model.config (model_type={model_type}) could not build a model: {one_line(e, 300)}: "
            "fix the model.config keys"
        ) from None


def pretrained_dir(path: str) -> Path:
    """``model.pretrained`` as an existing local model directory, or a one-line ``UserError``."""
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        hub_like = not str(path).startswith((".", "/", "~")) and str(path).count("/") <= 1
        hint = (
            "; it looks like a hub name: download it elsewhere (`hf download NAME --local-dir DIR`), then "
            "pass model.pretrained=DIR"
            if hub_like
            else ": pass a local save_pretrained() directory"
        )
        raise UserError(
            f"model.pretrained={str(path)!r} does not exist; clipamp runs offline and never downloads{hint}"
        )
    if not (p / "config.json").is_file():
        raise UserError(
            f"model.pretrained={str(path)!r} is not a model directory (no config.json): pass a "
            "directory written by model.save_pretrained()"
        )
    return p


@contextlib.contextmanager
def quiet_transformers() -> Iterator[list[str]]:
    """What ``transformers`` logs meanwhile (its load report, its warnings) is kept in the list it
    yields instead of printed, and its progress bars are off: the app's output stays its own lines."""
    from transformers.utils import logging as tlog

    kept: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record.getMessage())

    root = tlog.get_logger()
    handlers, root.handlers = root.handlers, [Keep()]
    bars = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:
        yield kept
    finally:
        root.handlers = handlers
        if bars:
            tlog.enable_progress_bar()


_MISMATCH = re.compile(
    r"^(\S+)\s*\|\s*MISMATCH\s*\|.*ckpt: torch\.Size\((\[.*?\])\) vs model:\s*torch\.Size\((\[.*?\])\)"
)


def from_pretrained(path: Path) -> nn.Module:
    offline()
    from transformers import AutoModelForCausalLM

    with quiet_transformers() as kept:
        try:
            return AutoModelForCausalLM.from_pretrained(
                str(path), local_files_only=True, dtype=torch.float32, use_cache=False
            )
        except Exception as e:
            found = [m.groups() for text in kept for line in text.splitlines() if (m := _MISMATCH.match(line.strip()))]
            reason = one_line(e, 300)
            if found:
                key, saved, wanted = found[0]
                more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
                reason = (
                    f"{len(found)} saved weights do not fit its config.json, e.g. {key}: saved {saved}, "
                    f"config {wanted}{more}"
                )
            raise UserError(
                f"model.pretrained={str(path)!r} could not be loaded as a causal LM: {reason}: "
                "pass a directory written by model.save_pretrained()"
            ) from None


def check_fits(model: nn.Module, vocab: int, seq_len: int, tokenizer_where: str) -> None:
    """The tokenizer's ids must index the embedding, and a window must fit the positions."""
    rows = model.get_input_embeddings().num_embeddings
    if vocab > rows:
        raise UserError(
            f"the tokenizer ({tokenizer_where}) has {vocab} tokens but the model's embedding has "
            f"{rows} rows: use the model's own tokenizer (data.tokenizer=DIR), or give the model "
            f"model.config.vocab_size>={vocab}"
        )
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise UserError(
            f"data.seq_len={seq_len} exceeds the model's max_position_embeddings={limit}: pass data.seq_len<={limit}"
        )


def adapt(model: nn.Module, pad_id: int, padded: bool) -> nn.Module:
    """Install the two call-convention hooks (see the module docstring); returns ``model``."""

    def before(module, args, kwargs):
        ids = args[0] if args else kwargs.pop("input_ids")
        kwargs = {**kwargs, "use_cache": False}
        if padded:
            real = ids != PAD
            kwargs["attention_mask"] = real.long()
            ids = ids.masked_fill(~real, pad_id)
        return (), {"input_ids": ids, **kwargs}

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(lambda module, args, output: output.logits)
    return model


def describe(model: nn.Module) -> str:
    n_all = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    kind = type(model).__name__
    return f"{kind} {n_all / 1e6:.2f}M params" + (f" ({n_train / 1e6:.2f}M trainable)" if n_train != n_all else "")


def precheck(m: ModelConfig) -> None:
    """The cheap checks, before any data is read: a pretrained directory, or a known model_type."""
    if m.pretrained:
        pretrained_dir(m.pretrained)
        return
    if not m.config:
        raise UserError(
            "model=hf needs model.config (model_type and sizes, see conf/model/hf*.yaml) or model.pretrained=DIR"
        )
    offline()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    model_type = m.config.get("model_type")
    if model_type not in CAUSAL:
        raise UserError(
            f"model.config.model_type={model_type!r} is not a transformers causal LM type: "
            f"pass one of {', '.join(_EXAMPLES)} (or any of the {len(CAUSAL)} in "
            "transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)"
        )
    check_keys(model_type, dict(m.config))


def build(m: ModelConfig, vocab: int) -> nn.Module:
    """The model of ``model=hf`` (not yet adapted): pretrained if given, else from ``model.config``."""
    precheck(m)
    if m.pretrained:  # the directory's config.json is the model; model.config (a preset's) is not used
        model = from_pretrained(pretrained_dir(m.pretrained))
        where = f"model.pretrained={m.pretrained!r}"
    else:
        with quiet_transformers():  # e.g. "If you want to use BertLMHeadModel as a standalone": check_causal says it
            model = from_config(m, vocab)
        where = f"model.config.model_type={m.config.get('model_type')!r}"
    check_causal(model, where)
    return model


def check_causal(model: nn.Module, where: str) -> None:
    """Refuse an encoder (BERT, RoBERTa, …: a masked-LM type whose config is not ``is_decoder``): its
    attention is bidirectional, so trained as a causal LM it sees the very tokens it predicts and the
    run "succeeds" on a leak. clipamp trains causal LMs only; masked-LM training is not supported."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED

    config = model.config
    if config.model_type in MASKED and not getattr(config, "is_decoder", False):
        raise UserError(
            f"{where} is {type(model).__name__}, an encoder (model_type {config.model_type!r}): its attention "
            "is bidirectional, so as a causal LM it would see the tokens it must predict; clipamp trains causal "
            f"LMs only (no masked-LM training): pass a decoder such as {', '.join(_EXAMPLES[:3])}, or "
            "model.config.is_decoder=true for causal attention"
        )
