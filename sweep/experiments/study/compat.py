"""Whether a named study can take this invocation's trials: the same task (its losses comparable) and the same
search (its ``clip.max_norm`` range and clipping band); each refusal names its own cause."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from typing import Any

from sweep.config.convert import flatten
from sweep.config.schema import Config
from sweep.errors import UserError

#: ``task_key``'s ``space.*`` entries of the ``clip.max_norm`` range, as the ``study.*`` keys a user types; the
#: anchor window's entry is ``[calibrate.window, calibrate.cap, amp.dtype]``.
_RANGE_NAMES = {
    "space.low": "study.max_norm_low",
    "space.high": "study.max_norm_high",
    "space.anchor": "study.anchor",
    "space.anchor_low": "study.anchor_low",
    "space.anchor_high": "study.anchor_high",
}
_WINDOW_NAMES = ("calibrate.window", "calibrate.cap", "amp.dtype")
_SEARCH_NAMES = {"space.band": "study.target_clip", "space.mode": "study.mode", "space.dtypes": "study.dtypes"}


#: Each config key a user can set, with its schema default: what a task key's absent entry stands for.
_DEFAULTS = flatten(dataclasses.asdict(Config()))
_PLAIN = re.compile(r"[\w./:@+~-]+")
_PATH_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")  # a key an override's key path names
_KEY_ESCAPED = re.compile(r"([\\()\[\]{}:=, \t])")  # escaped in a dict key (Hydra's and OmegaConf's grammar)


def _override(value: Any) -> str:
    """``value`` as a Hydra override's right-hand side: ``null``, ``true``, ``[0.01,0.2]``, ``0.1``, and a string
    quoted where Hydra would read it as something else (a table is set entry by entry: ``_way_back``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_override(v) for v in value) + "]"
    if isinstance(value, str) and (not _PLAIN.fullmatch(value) or value.lower() in ("null", "true", "false")):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


def _dict_text(table: dict[str, Any]) -> str:
    """``table`` in the dict form Hydra's overrides and OmegaConf's ``oc.create`` read: ``{attn.c_proj:0.5}``, each
    key's ``\\``, brackets, ``:``, ``=``, ``,`` and blanks escaped with a backslash."""
    items = (
        _KEY_ESCAPED.sub(r"\\\1", k) + ":" + (_dict_text(v) if isinstance(v, dict) else _override(v))
        for k, v in table.items()
    )
    return "{" + ",".join(items) + "}"


def _path_keys(table: Any) -> bool:
    """Every key of ``table`` (nested tables too) is one an override's key path names (no dot, no symbol)."""
    return not isinstance(table, dict) or all(_PATH_KEY.fullmatch(str(k)) and _path_keys(v) for k, v in table.items())


def _keys(table: dict[str, Any]) -> list[str]:
    return [k for key, v in table.items() for k in (key, *(_keys(v) if isinstance(v, dict) else ()))]


def _written(key: str) -> bool:
    """Whether ``_dict_text`` writes ``key`` so that Hydra's dict grammar (OmegaConf's is the same) reads it back:
    not ``^a``, ``#a``, ``é``, nor ``1`` or ``null``, which it reads as a number or ``None``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return list(OverridesParser.create().parse_override(f"k={_dict_text({key: 0})}").value()) == [key]
    except Exception:  # Hydra's OverrideParseException
        return False


def _whole_table(setting: str, old: Any, now: Any) -> str:
    """The override that gives the table ``setting`` the study's entries ``old`` where a key path cannot name each
    entry (``attn.c_proj``): its entries in Hydra's dict form, merged into the table set now, or, where an entry
    must go (no override removes a dotted key) or no table is set, the whole table replaced by ``oc.create``."""
    unwritten = [k for k in _keys(old) if not _written(k)]
    if unwritten:  # set in a config file: the grammar has no quoted key
        shown, key = (
            json.dumps(old, ensure_ascii=False),
            json.dumps(unwritten[0], ensure_ascii=False),
        )  # YAML reads both
        return f"{setting} as the study had it, {shown}, from a config file (no override writes the key {key})"
    if isinstance(now, dict) and set(now) <= set(old) and not any(isinstance(v, dict) for v in old.values()):
        override = f"++{setting}={_dict_text({k: v for k, v in old.items() if now.get(k) != v})}"
    else:
        override = f'{setting}="${{oc.create:{_dict_text(old)}}}"'
    return shlex.quote(override)


def _setting(key: str) -> str:
    """The config key a task key's flattened entry belongs to (``clip.patterns.attn`` → ``clip.patterns``)."""
    parts = key.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in _DEFAULTS), key)


def _way_back(stored: dict[str, Any], old: dict[str, Any], keys: list[str], now: dict[str, Any]) -> str:
    """The overrides that give the task's ``keys`` the study's values (``old``: its stored task, flattened; ``now``:
    this invocation's, as stored). A table (``clip.patterns``) is set entry by entry, as Hydra merges a table into
    the one already set: ``++`` for the study's entries, ``~`` for the ones it did not have, ``null`` where it had
    none; one whose keys a key path cannot name is set as ``_whole_table`` says."""
    out: list[str] = []
    for key in keys:
        setting = _setting(key)
        table = _table(stored, setting)
        if key != setting and isinstance(table, dict) and not (_path_keys(table) and _path_keys(_table(now, setting))):
            out.append(_whole_table(setting, table, _table(now, setting)))
        elif key == "clip.mode":  # the mode's own config group: its tables too (an empty one is not an override)
            out.insert(0, f"clip={old.get(key, _DEFAULTS[key])}")
        elif key == setting and old.get(key) != {}:  # merging an empty table changes nothing
            out.append(f"{key}={_override(old.get(key, _DEFAULTS.get(key)))}")
        elif key == setting:
            continue
        elif key in old:
            out.append(f"++{key}={_override(old[key])}")
        elif table is None:
            out.append(f"{setting}=null")
        else:
            out.append(f"~{key}")
    return " ".join(dict.fromkeys(out))


def _emptied(key: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """``key`` is an empty table on one side and holds entries on the other: its entries are the difference."""
    for empty, full in ((old, new), (new, old)):
        if empty.get(key) == {} and any(k.startswith(key + ".") for k in full):
            return True
    return False


def _table(stored: dict[str, Any], setting: str) -> Any:
    """The study's value of the table ``setting`` (``None``: it had none)."""
    node: Any = stored
    for part in setting.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _readable(key: dict[str, Any]) -> dict[str, Any]:
    """A ``task_key`` flattened, under the names a user types (the anchor window's entry split in three)."""
    flat = flatten(key)
    window = flat.pop("space.window", None)
    if isinstance(window, list) and len(window) == len(_WINDOW_NAMES):
        flat.update({f"space.window.{n}": v for n, v in zip(_WINDOW_NAMES, window, strict=True)})
    return flat


def _key(key: str) -> str:
    """The override that sets ``key``."""
    if key.startswith("space.window."):
        return key.removeprefix("space.window.")
    return _RANGE_NAMES.get(key) or _SEARCH_NAMES.get(key) or key


def _name(key: str) -> str:
    return f"the anchor window's {_key(key)}" if key.startswith("space.window.") else _key(key)


def refuse_another_task(study, now: dict[str, Any], named: bool) -> None:
    """A named study (``study.name``) holds the trials of one task searched over one space. ``UserError`` naming
    each difference with the study's stored ``task`` and why it matters: another task (steps, model, LR…) makes
    the losses incomparable; another ``clip.max_norm`` range (``study.max_norm_low/high``, the anchor, its
    band ``study.anchor_low/high`` or window) or clipping band (``study.target_clip``) would mix two searches in
    one sampler and one pick. Unnamed studies are named after their task and search, so never mix them."""
    stored = study.user_attrs.get("task")
    if stored is None or not named:
        return
    old = _readable(stored)
    new = _readable(json.loads(json.dumps(now, default=str)))  # as the storage holds it
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k) and not _emptied(k, old, new))
    if not keys:
        return

    def shown(values: dict[str, Any], k: str) -> Any:
        return values[k] if k in values else _DEFAULTS.get(k, "not set")

    def listed(ks: list[str]) -> str:
        return "; ".join(f"{_name(k)} (study: {shown(old, k)}, now: {shown(new, k)})" for k in ks)

    search = [k for k in keys if k.startswith("space.")]
    task = [k for k in keys if k not in search]
    causes = []
    if task:
        causes.append(f"holds the trials of another task: {listed(task)}; their losses are not comparable")
    ranged = [k for k in search if k in _RANGE_NAMES or k.startswith("space.window.")]
    if ranged:
        causes.append(
            f"searched clip.max_norm over another range: {listed(ranged)}; a study draws its trials from one range"
        )
    band = [k for k in search if k == "space.band"]
    if band:
        causes.append(
            f"judged its trials against another clipping band: {listed(band)}; each trial's constraint (its "
            "clipping ratio inside the band) was stored against that band"
        )
    other = [k for k in search if k not in ranged and k not in band]
    if other:
        causes.append(f"searched another space: {listed(other)}; its trials were sampled in that one")
    searched = (f"{_key(k)}={_override(old.get(k))}" for k in search)
    restore = " ".join(
        filter(None, (_way_back(stored, old, task, json.loads(json.dumps(now, default=str))), *searched))
    )
    if task:
        fix = f"pass {restore} to add trials to it, or another study.name (without one, the study is named after "
        fix += "its task)"
    else:
        fix = (
            f"pass {restore} to add trials to it, or another study.name for the new "
            f"{'range' if ranged and len(ranged) == len(search) else 'search'} (without one, the study is named "
            "after its task and search)"
        )
    raise UserError(f"study.name={study.study_name!r} {'; it '.join(causes)}: {fix}")
