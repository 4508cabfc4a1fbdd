"""Whether a named study can take this invocation's trials: the same task (its losses comparable) and the same
search (its ``clip.max_norm`` range and clipping band); each refusal names its own cause."""

from __future__ import annotations

import json
from typing import Any

from sweep.config.convert import flatten
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


def _override(value: Any) -> str:
    """``value`` as a Hydra override's right-hand side: ``null``, ``[0.01,0.2]``, ``0.1``."""
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(_override(v) for v in value) + "]"
    return str(value)


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
    keys = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if not keys:
        return

    def listed(ks: list[str]) -> str:
        return "; ".join(f"{_name(k)} (study: {old.get(k, 'default')}, now: {new.get(k, 'default')})" for k in ks)

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
    if task:
        fix = "pass the study's settings to add trials to it, or another study.name (without one, the study is "
        fix += "named after its task)"
    else:
        restore = " ".join(f"{_key(k)}={_override(old.get(k))}" for k in search)
        fix = (
            f"pass {restore} to add trials to it, or another study.name for the new "
            f"{'range' if ranged and len(ranged) == len(search) else 'search'} (without one, the study is named "
            "after its task and search)"
        )
    raise UserError(f"study.name={study.study_name!r} {'; it '.join(causes)}: {fix}")
