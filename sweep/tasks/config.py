"""Structured-config schema nodes for the ``model`` and ``data`` Hydra groups.

Plain dataclasses: Hydra/OmegaConf use them as schemas, and ``build_task``
accepts either these objects or DictConfigs with the same keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

MODEL_NAMES = ("gpt", "lstm", "linear", "custom")
DATA_NAMES = ("stdlib", "text", "synthetic")


@dataclass
class ModelConfig:
    """Which network to train. Defaults are the ``gpt`` task (~0.8M params)."""

    name: str = "gpt"  # gpt | lstm | linear | custom
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


@dataclass
class DataConfig:
    """Where batches come from. Defaults: the stdlib's own source code."""

    name: str = "stdlib"  # stdlib | text | synthetic
    path: Optional[str] = None  # text: a corpus file or a directory of files
    batch_size: int = 16
    seq_len: int = 128  # max tokens per sequence (<= model.block_size for gpt)
    max_files: int = 400  # stdlib: cap on documents read (deterministic choice)
    eval_fraction: float = 0.05  # held-out documents
    eval_batches: int = 4
