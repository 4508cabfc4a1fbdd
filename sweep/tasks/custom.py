"""``model=custom``: check a user's model once, before training, against what its loss needs."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..errors import UserError
from .models import VOCAB


@torch.no_grad()
def check_custom_output(model: nn.Module, loss_fn: Callable, batch: Any, m: Any, expected: str) -> None:
    """One eval-mode forward on a held-out ``batch``; refuse, in one line naming the expected output,
    a model without trainable parameters or an output its loss cannot use."""
    target = m._target_
    fix = f"make model._target_={target!r} return {expected}" + (
        "" if m.loss_target else " or pass model.loss_target=FN(output, targets)")
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"model._target_={target!r} has no trainable parameters: a custom model needs some to train")
    model.eval()
    try:
        try:
            out = model(batch.inputs)
        except Exception as e:
            raise UserError(f"model._target_={target!r} failed on inputs of shape {tuple(batch.inputs.shape)} "
                            f"({type(e).__name__}: {_first(e)}): {fix}") from None
        if not m.loss_target:
            want = (*batch.targets.shape, VOCAB) if batch.targets.dtype == torch.long else tuple(batch.targets.shape)
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
            if got != want:
                raise UserError(f"model._target_={target!r} returned {got} for inputs of shape "
                                f"{tuple(batch.inputs.shape)}; expected {expected} = {want}: {fix}")
        loss = loss_fn(out, batch.targets)
        total = loss[0] if isinstance(loss, tuple) else loss
        if not (isinstance(total, torch.Tensor) and total.numel() == 1 and total.is_floating_point()):
            raise UserError(f"model.loss_target={m.loss_target!r} returned {type(total).__name__}, not a scalar "
                            f"float tensor or (sum, count): fix the loss function")
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"model._target_={target!r}: its output failed in the loss ({type(e).__name__}: {_first(e)}); "
                        f"expected {expected}: {fix}") from None
    finally:
        model.train()


def _first(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]
