"""Structured-config schema nodes for the ``model`` and ``data`` Hydra groups.

Plain dataclasses: Hydra/OmegaConf use them as schemas, and ``build_task``
accepts either these objects or DictConfigs with the same keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

MODEL_NAMES = ("gpt", "lstm", "linear", "custom", "hf")
DATA_NAMES = ("stdlib", "text", "synthetic", "hf")


@dataclass
class ModelConfig:
    """Which network to train. Defaults are the ``gpt`` task (~0.8M params)."""

    name: str = "gpt"  # gpt | lstm | linear | custom | hf
    _target_: Optional[str] = None  # custom: dotted path of an nn.Module class/factory
    loss_target: Optional[str] = None  # custom: dotted path of loss_fn(output, targets)
    kwargs: Dict[str, Any] = field(default_factory=dict)  # custom: constructor kwargs
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    block_size: int = 128
    dropout: float = 0.0
    hidden: int = 256  # lstm hidden size (n_layer layers)
    in_features: int = 16  # linear
    out_features: int = 1  # linear
    # hf: a transformers causal LM, randomly initialised from ``config`` (``model_type`` + the
    # config class's keys; vocab_size null = the tokenizer's) or loaded from ``pretrained``
    config: Dict[str, Any] = field(default_factory=dict)
    pretrained: Optional[str] = None  # hf: a local save_pretrained directory (never downloaded)
    # any model: parameter-name regexes (re.search); frozen parameters are left out of the
    # optimizer, of every norm and of the forensics
    freeze: List[str] = field(default_factory=list)  # these do not train
    train_only: List[str] = field(default_factory=list)  # if set, only these train


@dataclass
class DataConfig:
    """Where batches come from. Defaults: the stdlib's own source code."""

    name: str = "stdlib"  # stdlib | text | synthetic | hf
    path: Optional[str] = None  # text: a corpus file or a directory of files
    batch_size: int = 16
    seq_len: int = 128  # max tokens per sequence (<= model.block_size for gpt)
    max_files: int = 400  # stdlib: cap on documents read (deterministic choice)
    eval_fraction: float = 0.05  # held-out documents
    eval_batches: int = 4
    # hf (and stdlib/text under model=hf): tokenized text
    files: Any = None  # hf: a file, a glob or a list of them (text/json/jsonl/parquet/csv/arrow)
    format: Optional[str] = None  # hf: datasets builder (text|json|parquet|csv|arrow); null = by extension
    text_field: str = "text"  # hf: the column holding the text
    source_field: Optional[str] = None  # hf: the column that becomes data_source (null: the file name)
    tokenizer: Optional[str] = None  # local tokenizer dir; null: model.pretrained's, else a BPE trained once
    vocab_size: int = 4096  # the trained BPE's vocabulary
    packing: bool = True  # true: documents back to back (EOS between); false: one padded document per row
    cache_dir: Optional[str] = None  # trained tokenizers; null: beside the data (else ~/.cache/clipamp)
