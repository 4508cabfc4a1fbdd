"""Unit-wise adaptive gradient clipping (AGC): each unit's gradient bounded relative to its weight.

References:
    Brock, De, Smith, Simonyan, "High-Performance Large-Scale Image Recognition Without
    Normalization", arXiv:2102.06171 (NFNets, AGC).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..norms import CLIP_EPS, accumulation_dtype, replicated, total_norm
from .base import (
    ClipPolicy,
    NamedParams,
    compile_patterns,
    embedding_param_ids,
    param_names,
    positive,
    refuse_unmatched,
    scale_each_,
)

__all__ = ["DEFAULT_AGC_EXCLUDE", "AdaptiveGradClip", "unitwise_norm"]

#: Default AGC exclusions by name (embeddings); 1-D tensors (biases, norm scales) are excluded
#: by ``exclude_1d``, and ``nn.Embedding`` weights by type when ``named_params`` is the model.
DEFAULT_AGC_EXCLUDE = (r"(^|\.)(wte|wpe|tok|pos)\.weight$", r"embed")


def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """NFNets unit-wise L2 norm: one norm per output unit (dim 0), reduced over the other dims
    and kept broadcastable; a vector or scalar is a single unit. Accumulates in at least fp32
    (fp64 stays fp64, as in timm's ``unitwise_norm``, which norms in the tensor's own dtype).

    Under FSDP2 (DTensor shards over dim 0) a unit's row is local; a vector's norm, or one over a
    sharded dim, is reduced over the mesh (``replicated``): the norm of the whole unit, on every rank."""
    acc = accumulation_dtype(x.dtype)
    if x.ndim <= 1:
        return replicated(torch.linalg.vector_norm(x, dtype=acc))
    return replicated(torch.linalg.vector_norm(x, dim=tuple(range(1, x.ndim)), keepdim=True, dtype=acc))


class AdaptiveGradClip(ClipPolicy):
    """Unit-wise adaptive gradient clipping (AGC, NFNets).

    For every unit *i* (a row of a weight matrix, an output channel of a conv kernel: dim 0,
    reduced over the other dims; a vector as one unit)::

        max_i = λ · max(‖W_i‖, eps)
        G_i ← G_i · max_i / ‖G_i‖   if ‖G_i‖ > max_i   (else unchanged)

    with ``λ = clip_factor``. A relative bound: the same gradient norm is fine for a large
    weight and too much for a small one. Units change by different factors, so the
    full gradient's direction changes. Biases, norm scales and embeddings have small or
    special norms and are excluded by default, as in the paper (which also leaves the final
    classifier unclipped: add its name to ``exclude``). Sparse gradients are never clipped
    by AGC. The unit norms cost one reduction per tensor (no fused kernel reduces over
    dims); the coefficients and the scaling are fused.

    Args:
        clip_factor: λ (paper: 0.01 for large batches; up to ~0.16 for small ones).
        eps: floor on the weight norm, so zero-initialised units can still move (1e-3).
        exclude: regexes (``re.search``) over parameter names to leave unclipped; ``None``
            means ``DEFAULT_AGC_EXCLUDE`` plus every ``nn.Embedding`` weight when
            ``named_params`` is the model (without ``named_params``, from the model
            ``AmpTrainState`` binds; used alone, only ``exclude_1d`` applies). Explicit
            non-empty patterns need ``named_params``.
        exclude_1d: leave 1-D (and 0-D) parameters unclipped (biases, norm scales).
        named_params: ``model`` or ``model.named_parameters()`` (context).

    References:
        Brock, De, Smith, Simonyan, "High-Performance Large-Scale Image Recognition Without
        Normalization", arXiv:2102.06171 (NFNets, AGC).
    """

    mode = "agc"

    def __init__(
        self,
        clip_factor: float = 0.01,
        eps: float = 1e-3,
        exclude: Sequence[str] | None = None,
        exclude_1d: bool = True,
        *,
        named_params: NamedParams | None = None,
    ) -> None:
        self.clip_factor = positive("clip_factor", clip_factor)
        self.eps = positive("eps", eps)
        self.exclude_1d = bool(exclude_1d)
        if isinstance(exclude, str):
            exclude = [exclude]
        self._by_default = exclude is None and named_params is None  # the model's names come at bind_model
        if exclude is None:
            self._excluded_ids = _excluded_by_default(named_params)
        else:
            patterns = tuple(exclude)
            if patterns and named_params is None:
                raise ValueError(
                    "agc exclude patterns match parameter names: pass "
                    "named_params=model.named_parameters() (or the model), or exclude=[]"
                )
            names = param_names(named_params)
            self._excluded_ids = _matching(names, patterns)  # a pattern that does not compile is refused first
            refuse_unmatched("agc exclude", list(patterns), list(names.values()))
        self._key: tuple | None = None
        self._selected: list[int] = []

    def bind_model(self, model: torch.nn.Module) -> None:
        """Built without ``named_params``: exclude the model's embeddings as the default does with them
        (``AmpTrainState(model, ..., clip=make_clip_policy("agc"))`` clips what the runner's ``clip=agc`` does)."""
        if self._by_default:
            self._excluded_ids = _excluded_by_default(model)
            self._key, self._by_default = None, False

    def _select(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> list[int]:
        key = tuple(map(id, params))
        if key != self._key:
            self._selected = [
                i
                for i, (p, g) in enumerate(zip(params, grads))
                if id(p) not in self._excluded_ids and not g.is_sparse and not (self.exclude_1d and p.ndim <= 1)
            ]
            self._key = key
        return self._selected

    def clip_(self, params, grads, pre, step):
        sel = self._select(params, grads)
        if not sel:
            return pre
        max_norms = [unitwise_norm(params[i].detach()) for i in sel]  # one reduction per tensor
        grad_norms = [unitwise_norm(grads[i]) for i in sel]
        torch._foreach_clamp_min_(max_norms, self.eps)
        torch._foreach_mul_(max_norms, self.clip_factor)
        torch._foreach_clamp_min_(grad_norms, CLIP_EPS)
        coef = torch._foreach_div(max_norms, grad_norms)
        torch._foreach_clamp_max_(coef, 1.0)
        scale_each_([grads[i] for i in sel], coef)
        return total_norm(grads)


def _matching(names: dict[int, str], patterns: tuple[str, ...]) -> set[int]:
    """The ids of the parameters whose name ``re.search``-matches one of ``patterns``."""
    regexes = compile_patterns(patterns, "agc exclude")
    return {pid for pid, name in names.items() if any(r.search(name) for r in regexes)}


def _excluded_by_default(named_params: NamedParams | None) -> set[int]:
    """What ``exclude=None`` leaves unclipped: every ``nn.Embedding`` weight and the names matching
    ``DEFAULT_AGC_EXCLUDE`` (none without ``named_params``)."""
    return embedding_param_ids(named_params) | _matching(param_names(named_params), DEFAULT_AGC_EXCLUDE)
