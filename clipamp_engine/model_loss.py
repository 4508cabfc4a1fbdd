"""The loss of one micro-batch: ``loss_fn(model(inputs), targets)``, or the model's own loss.

Many models compute their loss themselves from the targets: nanoGPT's ``model(idx, targets)``
returns ``(logits, loss)``, a Hugging Face model called with ``labels=`` returns an output whose
``.loss`` is set. With ``loss_fn=None`` the step calls the model with the targets and takes that
loss: ``model(inputs, targets)``, or ``model(**inputs, labels=targets)`` when ``inputs`` is a
mapping (a tokenizer's batch). Any other output is one ``ValueError`` naming the forms expected;
a ``loss_fn``'s result is checked by ``clipamp_engine.checks.checked_loss``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .checks import checked_loss

__all__ = ["EXPECTED_MODEL_OUTPUT", "loss_function", "model_loss"]

EXPECTED_MODEL_OUTPUT = (
    "a tuple holding one scalar loss tensor (nanoGPT's (logits, loss)), a dict with a 'loss' tensor, "
    "or an object whose .loss is a scalar tensor (Hugging Face's ModelOutput)"
)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {', '.join(_describe(v) for v in value) or 'nothing'}"
    return "None" if value is None else f"a {type(value).__name__}"


def _is_loss(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def model_loss(output: Any) -> torch.Tensor:
    """The scalar loss in a model's output (a tuple, a mapping, or an object with ``.loss``).

    Raises:
        ValueError: no single scalar loss in ``output``; the message names the expected forms.
    """
    if isinstance(output, Mapping):  # a dict, or a transformers ModelOutput (an OrderedDict)
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)):
        losses = [v for v in output if _is_loss(v)]
        loss = losses[0] if len(losses) == 1 else None
    else:
        loss = getattr(output, "loss", None)
    if not _is_loss(loss):
        raise ValueError(
            f"the model computes its own loss (loss_fn=None) but returned {_describe(output)}: "
            f"expected {EXPECTED_MODEL_OUTPUT}"
        )
    return loss


def loss_function(model: nn.Module, loss_fn: Callable[[Any, Any], Any] | None) -> Callable[[Any, Any], Any]:
    """``(inputs, targets) -> loss`` for one micro-batch, run inside the step's autocast.

    With ``loss_fn=None``: ``model(inputs, targets)``, or ``model(**inputs, labels=targets)`` for a mapping;
    ``targets=None`` calls ``model(inputs)`` (``model(**inputs)``: a batch that holds its own ``labels``).
    A model whose ``forward`` takes neither the targets nor ``labels`` is a ``ValueError`` here, at
    construction; a mapping that holds ``labels`` with targets given too, at the step.
    """
    if loss_fn is not None:
        return lambda x, y: checked_loss(loss_fn(model(x), y))
    if not _takes_targets(model):
        raise ValueError(
            f"loss_fn=None means the model computes its own loss from the targets (model(inputs, targets), or "
            f"model(**inputs, labels=targets)), and {type(model).__name__}.forward takes neither: pass "
            "loss_fn (e.g. torch.nn.functional.mse_loss), which the step calls as loss_fn(model(inputs), targets)"
        )

    def own(x: Any, y: Any) -> torch.Tensor:
        if isinstance(x, Mapping):
            if y is not None and "labels" in x:
                raise ValueError(
                    "the batch holds 'labels' and targets were given too: pass targets=None to train on the "
                    "batch's own labels (state.step(batch, None)), or leave 'labels' out of the batch"
                )
            return model_loss(model(**x) if y is None else model(**x, labels=y))
        return model_loss(model(x) if y is None else model(x, y))

    return own


def _takes_targets(model: nn.Module) -> bool:
    """Whether ``model.forward`` can take ``(inputs, targets)`` or ``labels=`` (an unreadable signature: yes)."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return True
    kinds = {p.kind for p in params}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = {p.name for p in params}
    return bool(kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}) or (
        len(positional) >= 2 or "labels" in names
    )
