"""Config objects as plain data: dicts, flat MLflow params, YAML, merged ``KEY=VALUE`` overrides."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from omegaconf import OmegaConf

from sweep.config.schema import Config
from sweep.errors import UserError


def as_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass (or DictConfig) as nested plain dicts, interpolations resolved."""
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True)


def as_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (empty dicts stay leaves): the MLflow params of a config."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def flat_params(cfg: Config) -> dict[str, Any]:
    return flatten(as_dict(cfg))


def child_config(cfg: Config, **changes: Any) -> Config:
    """A copy for a child run of a study or experiment: no step bar, no periodic checkpoints, no resume."""
    c = copy.deepcopy(cfg)
    c.progress, c.checkpoint_every, c.resume = False, 0, None
    for k, v in changes.items():
        setattr(c, k, v)
    return c


def with_overrides(cfg: Config, overrides: Sequence[str], key: str) -> Config:
    """``cfg`` with ``KEY=VALUE`` overrides merged through the schema (unknown keys/types refused)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged)
    except Exception as e:  # OmegaConf validation errors
        raise UserError(f"{key}={list(overrides)}: {' '.join(str(e).split()).split(' full_key:')[0]}; "
                        f"pass KEY=VALUE items of the config, e.g. model.d_model=32") from None
