"""The loss of one micro-batch: ``loss_fn(model(inputs), targets)``, or the model's own loss.

Many models compute their loss themselves from the targets: nanoGPT's ``model(idx, targets)``
returns ``(logits, loss)``, a Hugging Face model called with ``labels=`` returns an output whose
``.loss`` is set, others return the scalar loss alone. With ``loss_fn=None`` the step calls the
model with the targets and takes that loss: ``model(inputs, targets)``, ``model(inputs,
labels=targets)`` when ``forward`` takes ``labels`` (a Hugging Face model, whose second positional
parameter is something else), or ``model(**inputs, labels=targets)`` when ``inputs`` is a mapping
(a tokenizer's batch). Any other output is one ``ValueError`` naming the forms expected; a
``loss_fn``'s result is checked by ``clipamp_engine.checks.checked_loss``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .checks import checked_loss
from .distributed import unwrap

__all__ = ["EXPECTED_MODEL_OUTPUT", "loss_function", "model_loss"]

EXPECTED_MODEL_OUTPUT = (
    "the scalar loss tensor itself, a tuple holding one scalar loss tensor (nanoGPT's (logits, loss)), "
    "a dict with a 'loss' tensor, or an object whose .loss is a scalar tensor (Hugging Face's ModelOutput)"
)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {', '.join(_describe(v) for v in value) or 'nothing'}"
    if isinstance(value, Mapping):  # its keys, and its 'loss' if any (a ModelOutput leaves out a None one)
        keys = f"a {type(value).__name__} with keys {', '.join(map(repr, value)) or '(none)'}"
        return f"{keys} ('loss' is {_describe(value['loss'])})" if "loss" in value else f"{keys} and no 'loss'"
    return "None" if value is None else f"a {type(value).__name__}"


def _is_loss(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def model_loss(output: Any, without_targets: bool = False) -> torch.Tensor:
    """The scalar loss a model returned: itself, or in a tuple, a mapping, or an object with ``.loss``.

    Raises:
        ValueError: no single scalar loss in ``output``; the message names the expected forms (and,
            ``without_targets``, that the model was called without targets, the likely cause).
    """
    if isinstance(output, torch.Tensor):  # the loss itself (``return F.cross_entropy(...)``), or a refused tensor
        loss = output
    elif isinstance(output, Mapping):  # a dict, or a transformers ModelOutput (an OrderedDict)
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
            + (
                "; it was called without targets (targets=None): pass them, state.step(inputs, targets), "
                "or a batch that holds its 'labels'"
                if without_targets
                else ""
            )
        )
    return loss


def loss_function(model: nn.Module, loss_fn: Callable[[Any, Any], Any] | None) -> Callable[[Any, Any], Any]:
    """``(inputs, targets) -> loss`` for one micro-batch, run inside the step's autocast.

    With ``loss_fn=None``: ``model(inputs, targets)`` (``model(inputs, labels=targets)`` when ``forward`` takes
    ``labels``), or ``model(**inputs, labels=targets)`` for a mapping;
    ``targets=None`` calls ``model(inputs)`` (``model(**inputs)``: a batch that holds its own ``labels``).
    A model whose ``forward`` takes neither the targets nor ``labels`` is a ``ValueError`` here, at
    construction; a mapping that holds ``labels`` with targets given too, at the step.
    """
    if loss_fn is not None:
        return lambda x, y: checked_loss(loss_fn(model(x), y))
    params = _forward_params(model)
    if params is not None and not _takes_targets(params):
        raise ValueError(
            f"loss_fn=None means the model computes its own loss from the targets (model(inputs, targets), or "
            f"model(**inputs, labels=targets)), and {type(unwrap(model)).__name__}.forward takes neither: pass "
            "loss_fn (e.g. torch.nn.functional.mse_loss), which the step calls as loss_fn(model(inputs), targets)"
        )

    def own(x: Any, y: Any) -> torch.Tensor:
        if isinstance(x, Mapping):
            if y is not None and "labels" in x:
                raise ValueError(
                    "the batch holds 'labels' and targets were given too: pass targets=None to train on the "
                    "batch's own labels (state.step(batch, None)), or leave 'labels' out of the batch"
                )
            return model_loss(model(**x) if y is None else model(**x, labels=y), y is None and "labels" not in x)
        if y is None:
            return model_loss(model(x), without_targets=True)
        return model_loss(model(x, labels=y) if by_name else model(x, y))

    by_name = _labels_by_name(params)
    return own


def _forward_params(model: nn.Module) -> list[inspect.Parameter] | None:
    """The parameters of the forward the model runs: past ``DistributedDataParallel`` and ``torch.compile``
    wrappers (``unwrap``), whose own forwards take ``*args, **kwargs``; ``None`` if unreadable."""
    model = unwrap(model)
    try:
        return list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None


def _takes_targets(params: list[inspect.Parameter]) -> bool:
    """Whether a forward of these parameters can take ``(inputs, targets)`` or ``labels=``."""
    kinds = {p.kind for p in params}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return bool(kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}) or (
        len(positional) >= 2 or any(p.name == "labels" for p in params)
    )


def _labels_by_name(params: list[inspect.Parameter] | None) -> bool:
    """Whether ``targets`` go in as ``labels=``: the forward takes ``labels`` and a positional call would put
    them elsewhere (a Hugging Face model's second positional parameter is ``past_key_values`` or
    ``attention_mask``) or nowhere (``forward(x, *, labels)``). A forward whose second positional parameter
    takes the targets (nanoGPT's ``forward(idx, targets)``) gets them there, even beside a keyword-only ``labels``."""
    params = params or []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    labels = next((p for p in params if p.name == "labels"), None)
    if labels is None or (len(positional) >= 2 and positional[1] is labels):
        return False
    return labels.kind is labels.POSITIONAL_OR_KEYWORD or len(positional) < 2
