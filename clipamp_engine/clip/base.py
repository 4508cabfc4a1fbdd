"""The clipping-policy base class and the helpers the policies share.

Gradients reach a policy as the list ``grads_of`` returned (``None`` skipped, sparse COO
coalesced). Sparse gradients are handled through their values tensor (``dense_views``), never
densified: a coalesced tensor's values are exact, and scaling them in place keeps the
tensor coalesced (``sparse.mul_`` would clear the flag and make ``values()`` raise).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..gradients import GradientSource
from ..norms import CLIP_EPS, dense_views, group_indices, scale_grads_
from ..records import StepLog

NamedParams = nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class ClipPolicy:
    """Base policy. Subclasses override ``clip_``; the hooks default to no-ops.

    ``clip_`` receives the parameters that have gradients, their gradients (same order,
    unscaled, accumulated), the finite pre-clip global L2 norm (0-dim tensor, fp64 if any
    gradient is fp64, else fp32) and the 1-based step; it scales the gradients in place and
    returns the post-clip global L2 norm as a 0-dim tensor (no host sync). It is only called
    on steps that are taken, so a skipped step never changes what a policy learnt from
    gradients; ``observe`` then sees every finished record, taken or skipped (host values, no
    sync).

    Capabilities a policy declares (the step asks them, never the policy's type):

    - ``single_coefficient``: the clip multiplies every gradient by one scalar,
      ``coefficient(pre, step)``; the fused path (``clipamp_engine.fused``) then folds it into the
      optimizer's own pass. ``GlobalCoefficientClip`` implements ``clip_`` from it.
    - ``gradient_source``: a ``GradientSource`` that produces the gradients itself (DP-SGD), used
      instead of the scaled ``loss.backward()``; ``None`` for the default.
    - ``needs_whole_params``: the policy indexes or snapshots whole parameters, which FSDP2's
      shards are not (the step refuses it there).
    """

    mode = "base"
    #: Whether ``coefficient(pre, step)`` is the whole clip of every step (see the class docstring).
    single_coefficient = False
    #: Whether the policy needs whole (unsharded) parameters (see the class docstring).
    needs_whole_params = False
    #: The extra record columns ``after_step`` returns.
    columns: tuple[str, ...] = ()

    @property
    def gradient_source(self) -> GradientSource | None:
        """The source of the gradients this policy clips (``None``: the step's scaled backward)."""
        return None

    def clip_(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], pre: torch.Tensor, step: int
    ) -> torch.Tensor:
        raise NotImplementedError

    def coefficient(self, pre: torch.Tensor, step: int) -> torch.Tensor:
        """The one scalar every gradient is multiplied by at ``step`` (0-dim, no sync); only for
        policies with ``single_coefficient``. Sets what ``threshold`` reports.

        The fused path calls it on every step, before the skip is known: also on steps that end up
        skipped (a non-finite ``pre`` or loss), whose coefficient is then discarded
        (``clipamp_engine.fused.global_coefficient``). So it must have no side effects that assume
        a finite ``pre`` or a taken step (learn from gradients in ``observe`` instead).
        """
        raise NotImplementedError(f"clip mode {self.mode!r} is not one global coefficient")

    @property
    def threshold(self) -> float | None:
        """The threshold in force for the latest step (for records), if the mode has one."""
        return None

    def threshold_at(self, step: int) -> float | None:
        """The threshold a skipped ``step`` records (its clip never ran): ``threshold``, unless the
        policy knows it from the step alone (``StagedNormClip``)."""
        return self.threshold

    def bind_model(self, model: nn.Module) -> None:
        """Called once by ``AmpTrainState`` with its model (unwrapped): a policy built without the
        ``named_params`` its defaults select by takes them from it. Nothing here."""

    def before_step(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        """Called right before the optimizer update of a taken step."""

    def after_step(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Called right after the optimizer update of a taken step; returns extra record columns."""
        return {}

    def observe(self, record: StepLog) -> None:
        """Called with every step's finished record (``StepLog`` or ``SkipLog``), in step order, when
        ``AmpTrainState.flush`` materialises it: at once on the default path; on the fused path every
        ``log_every`` steps, or earlier when ``needs_records`` asks.

        A ``ValueError`` raised here reaches the caller of ``AmpTrainState.step``, ``step_deferred``
        or ``flush`` with the record attached as ``.record`` and the flush's records as ``.records``
        (the steps themselves already happened).
        """

    def needs_records(self, step: int) -> bool:
        """Whether ``observe`` must see the records up to ``step`` before the next step runs (e.g. a
        calibration window closes at ``step``): the fused path then flushes early, so what the policy
        learns applies from the same step as on the default path."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class GlobalCoefficientClip(ClipPolicy):
    """A policy whose clip is one global coefficient: ``g ← g · coefficient(pre, step)`` for every gradient.

    Subclasses implement ``coefficient``; ``clip_`` scales the gradients by it (sparse ones through
    their values) and returns ``pre · coefficient``, the post-clip norm.
    """

    single_coefficient = True

    def clip_(self, params, grads, pre, step):
        coef = self.coefficient(pre, step)
        scale_grads_(grads, coef)
        return pre * coef


# -- option checks and record values ---------------------------------------------------------


def positive(name: str, value: Any) -> float:
    """``value`` as a finite float > 0, else a ``ValueError`` naming the option."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a number > 0") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    return v


def host_float(t: torch.Tensor | None) -> float | None:
    return None if t is None else float(t)  # sync: a record field, read once per step after the record's sync


# -- tensor-list helpers (fused, no host sync) ----------------------------------------------


def scale_each_(tensors: Sequence[torch.Tensor], factors: Sequence[torch.Tensor]) -> None:
    """Multiply tensor i in place by ``factors[i]`` (a tensor broadcastable to it; fused)."""
    views = dense_views(tensors)
    for (device,), idx in group_indices(views, with_dtype=False).items():
        torch._foreach_mul_([views[i] for i in idx], [factors[i].to(device) for i in idx])


def coefficient_above(norm: torch.Tensor, tau: torch.Tensor | float, eps: float = CLIP_EPS) -> torch.Tensor:
    """``τ / (norm + eps)`` where ``norm > τ``, else exactly 1 (branch-free, no sync).

    Unlike ``clip_coefficient`` (torch's ``min(1, τ/(n+ε))``), a norm at or under τ is left
    bit-for-bit untouched, which the adaptive modes need (τ can equal the norm itself).
    ``eps=0`` gives the scale-free ``τ / norm`` (safe: ``norm > τ ≥ 0`` where it is used).
    """
    return torch.where(norm > tau, tau / (norm + eps), torch.ones_like(norm))


# -- naming and optimizer structure ---------------------------------------------------------


def param_names(named_params: NamedParams | None) -> dict[int, str]:
    """``id(param) → name`` from a module, a ``{name: param}`` mapping or ``(name, param)`` pairs."""
    if named_params is None:
        return {}
    if isinstance(named_params, nn.Module):
        items = named_params.named_parameters()
    elif isinstance(named_params, Mapping):
        items = named_params.items()
    else:
        items = named_params
    names: dict[int, str] = {}
    for name, p in items:
        if not isinstance(name, str) or not isinstance(p, torch.Tensor):
            raise ValueError(
                "named_params must be a module, a {name: parameter} mapping or (name, parameter) pairs "
                "such as model.named_parameters()"
            )
        names.setdefault(id(p), name)
    return names


def embedding_param_ids(named_params: NamedParams | None) -> set[int]:
    """Ids of ``nn.Embedding`` / ``nn.EmbeddingBag`` weights when ``named_params`` is a module."""
    if not isinstance(named_params, nn.Module):
        return set()
    return {id(m.weight) for m in named_params.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


def refuse_unmatched(
    option: str, patterns: Sequence[str], names: Sequence[str], selected: Sequence[int] | None = None
) -> None:
    """Refuse a name pattern that selects no parameter: a typo or a wrong prefix, whose setting would
    silently do nothing. ``selected``: how many parameters each pattern got where the first matching
    pattern wins (a pattern shadowed by earlier ones is refused too)."""
    regexes = compile_patterns(patterns, option)
    for j, (pat, rx) in enumerate(zip(patterns, regexes)):
        if not any(rx.search(n) for n in names):
            raise ValueError(
                f"{option}: {pat!r} matches no parameter name (names look like {', '.join(names[:4])}): fix the pattern"
            )
        if selected is not None and selected[j] == 0:
            earlier = next(p for p, r in zip(patterns, regexes[:j]) if any(r.search(n) and rx.search(n) for n in names))
            raise ValueError(
                f"{option}: {pat!r} selects no parameter: every name it matches is taken by the earlier "
                f"pattern {earlier!r} (the first matching pattern wins): reorder or narrow the patterns"
            )


def compile_patterns(patterns: Iterable[str], option: str) -> list[re.Pattern[str]]:
    compiled = []
    for pat in patterns:
        try:
            compiled.append(re.compile(pat))
        except (re.error, TypeError) as e:
            raise ValueError(f"{option}: {pat!r} is not a valid regular expression ({e})") from None
    return compiled
