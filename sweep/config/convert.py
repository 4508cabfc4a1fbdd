"""Config objects as plain data: dicts, flat MLflow params, YAML, merged ``KEY=VALUE`` overrides."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from omegaconf import OmegaConf

from sweep.config.keys import refuse_unknown_keys
from sweep.config.schema import RENAMED, Config, ModelConfig
from sweep.errors import UserError


def as_dict(cfg: Any) -> dict[str, Any]:
    """A config dataclass (or DictConfig) as nested plain dicts, interpolations resolved."""
    node = cfg if OmegaConf.is_config(cfg) else OmegaConf.structured(cfg)
    return OmegaConf.to_container(node, resolve=True)


def to_config(node: Any) -> Config:
    """The typed ``Config`` of a composed tree (what ``python -m sweep`` runs with).

    Keys added to ``model`` beyond the schema (``+model.d=64``, ``+model._args_=[…]``) are a custom
    model's constructor arguments: they move into ``model.kwargs`` (logged, checked on resume), and
    are refused for the built-in models instead of being silently ignored. ``spike.horizons`` is a set of
    steps after the spike: kept in increasing order, each once, whatever order the command gave.
    """
    model = node.get("model") if OmegaConf.is_dict(node) else None
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    extra = [k for k in (model.keys() if model is not None else ()) if k not in known]
    if extra and model.get("name") != "custom":
        raise UserError(
            f"model.{extra[0]} is not a key of model={model.get('name')} (see its keys with --cfg job): "
            f"drop it, or pass model=custom model._target_=… whose constructor takes {extra[0]}"
        )
    if extra:
        plain = OmegaConf.to_container(model, resolve=False)  # interpolations stay for to_object
        kwargs = plain["kwargs"]
        for key in extra:
            if key in kwargs:
                raise UserError(f"model.{key} and model.kwargs.{key} are both set: keep one")
            kwargs[key] = plain.pop(key)
        node.model = OmegaConf.merge(OmegaConf.structured(ModelConfig), plain)
    if OmegaConf.is_dict(node):
        refuse_unknown_keys(OmegaConf.to_container(node, resolve=False))  # +clip.maxnorm=1 would be ignored
    cfg = OmegaConf.to_object(node)
    cfg.resume = resume_value(cfg.resume)
    cfg.spike.horizons = sorted(set(cfg.spike.horizons))  # the table's columns in time order, each once
    return cfg


def resume_value(value: str | None) -> str | None:
    """``resume=`` as the user wrote it. Hydra reads ``true``/``false`` as booleans, which the ``str`` field
    keeps as ``"True"``/``"False"``: ``true`` becomes ``"true"`` again (what lines echo back as ``resume=true``),
    ``false`` no resume (``None``, not a run id named ``False``); a run id or ``last`` is kept."""
    if value is not None and value.lower() in ("true", "false"):
        return "true" if value.lower() == "true" else None
    return value


def refuse_renamed(overrides: Sequence[str]) -> None:
    """``UserError`` for an override of a key that ``RENAMED`` lists, naming the key to pass instead."""
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.lstrip("+~")
        if key in RENAMED:
            raise UserError(f"{key} is now {RENAMED[key].replace('{value}', value)}")


def as_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml(text: str) -> Config:
    """The ``Config`` that ``as_yaml`` wrote (checked against the schema)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(text)))


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


#: ``model.*`` keys that size the built-in models, by the model that reads them (synthetic data reads
#: ``in_features``/``out_features`` for any model); a run logs only the ones its model reads.
SIZE_KEYS = {
    "gpt": ("d_model", "n_layer", "n_head", "block_size", "dropout"),
    "lstm": ("d_model", "hidden", "n_layer", "dropout"),
    "linear": ("in_features", "out_features"),
}


def flat_params(cfg: Config) -> dict[str, Any]:
    """The MLflow params of ``cfg``, without the size keys of built-in models that its model does not read."""
    used = set(SIZE_KEYS.get(cfg.model.name, ()))
    if cfg.data.name == "synthetic":
        used |= {"in_features", "out_features"}
    unread = {f"model.{k}" for keys in SIZE_KEYS.values() for k in keys} - {f"model.{k}" for k in used}
    return {k: v for k, v in flatten(as_dict(cfg)).items() if k not in unread}


def child_config(cfg: Config, **changes: Any) -> Config:
    """A copy for a child run of a study or experiment: no step bar, no periodic checkpoints, no resume."""
    c = copy.deepcopy(cfg)
    c.progress, c.checkpoint_every, c.resume = False, 0, None
    for k, v in changes.items():
        setattr(c, k, v)
    return c


def with_overrides(cfg: Config, overrides: Sequence[str], key: str) -> Config:
    """``cfg`` with ``KEY=VALUE`` overrides merged through the schema (unknown keys/types refused)."""
    refuse_renamed(overrides)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged)
    except Exception as e:  # OmegaConf validation errors
        raise UserError(
            f"{key}={list(overrides)}: {' '.join(str(e).split()).split(' full_key:')[0]}; "
            f"pass KEY=VALUE items of the config, e.g. model.d_model=32"
        ) from None
