"""The parameters a step norms and clips, in the order the canonical recipe sums them.

``torch.nn.utils.clip_grad_norm_(model.parameters(), τ)`` sums the per-tensor norms in
``model.parameters()`` order. A float sum depends on its order, so a norm summed in the
optimizer's param-group order (nanoGPT's decay / no-decay groups, say) can differ from it in the
last bit, and under bf16 with clipping active that difference grows step by step. The engine
therefore norms the optimizer's parameters in model order: the same norm, the same clip
coefficient and the same update as the canonical recipe.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["optimizer_params_in_model_order", "param_groups_key"]


def optimizer_params_in_model_order(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters, each once, in ``model.parameters()`` order.

    Parameters the optimizer holds but the model does not (extra tensors) follow, in param-group
    order; parameters of the model that the optimizer does not hold are left out (they are never
    updated, so they are neither normed nor clipped).
    """
    held: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            held.setdefault(id(p), p)
    ordered: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        if id(p) in held:
            ordered.setdefault(id(p), p)
    for pid, p in held.items():
        ordered.setdefault(pid, p)
    return list(ordered.values())


def param_groups_key(optimizer: torch.optim.Optimizer) -> tuple[tuple[int, int], ...]:
    """What changes when the optimizer's parameters do: each group's list and its length.

    ``add_param_group`` (progressive unfreezing) appends a group; editing a group's ``params`` list
    changes its length, replacing it changes its identity. A loop over the groups, not the parameters.
    """
    return tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
