"""``model=custom``: build a user's model with Hydra's ``instantiate`` and check it once, before
training, against what its loss needs.

The node handed to ``hydra.utils.instantiate`` is ``{_target_: model._target_, **model.kwargs}``
(keys added with ``+model.KEY=…`` are folded into ``model.kwargs`` when the config is built),
plus ``config: model.config`` when that is set: nested ``_target_`` nodes are built first (e.g.
a ``transformers.GPT2Config`` for a ``GPT2LMHeadModel``), ``_args_``/``_partial_``/``_recursive_``
work as in Hydra, and containers arrive as plain dicts and lists (``_convert_: all`` unless set).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import UserError, one_line
from .models import VOCAB


def locate(path: str, key: str) -> Any:
    """Import ``pkg.mod.Attr`` (attribute chains allowed) or raise a one-line UserError."""
    parts = str(path).split(".")
    err: BaseException | None = None
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError as e:
            err = err or e
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            return obj
        except AttributeError as e:
            err = e
            break
    err = err or ImportError("not a dotted path")
    raise UserError(
        f"{key}={path!r} could not be imported: {one_line(err)}: pass {key}=package.module.Name of an importable object"
    ) from None


def _hydra_error(e: BaseException) -> str:
    """Hydra's InstantiationException on one line, its cause named, without the HYDRA_FULL_ERROR hint."""
    text = " ".join(str(e).replace(", set env var HYDRA_FULL_ERROR=1 to see chained exception.", "").split())
    cause = e.__cause__
    if cause is not None and " ".join(str(cause).split()) not in text:
        text += f" ({' '.join(str(cause).split())})"
    return text


def build_custom(m: Any) -> tuple[nn.Module, Callable | None]:
    """``model=custom`` -> (model, loss_fn or None for the data's default loss); one-line errors."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    target = m._target_
    if not target:
        raise UserError(
            "model._target_ is not set for model.name=custom: pass "
            "model._target_=package.module.Class (e.g. sweep.tasks.models.TinyMLPLM)"
        )
    if m.pretrained:
        raise UserError(
            f"model.pretrained={m.pretrained!r} is for model=hf: for model=custom pass the "
            "constructor's arguments (+model.KEY=VALUE or model.kwargs)"
        )
    locate(target, "model._target_")
    kwargs = dict(m.kwargs or {})
    if kwargs.get("_partial_"):
        raise UserError(
            "model._partial_=true would make the model a factory, not an nn.Module: drop it "
            "(_partial_ belongs in nested nodes, e.g. +model.activation={_target_: …, _partial_: true})"
        )
    if m.config:
        if "config" in kwargs:
            raise UserError("model.config and model.kwargs.config are both set: keep one")
        kwargs["config"] = m.config
    node = {"_convert_": "all", **kwargs, "_target_": target}
    try:
        model = instantiate(node)
    except InstantiationException as e:
        raise UserError(
            f"model._target_={target!r} failed with model.kwargs={kwargs}: {_hydra_error(e)}: "
            "fix model.kwargs (nested _target_ nodes included) to match the signatures"
        ) from None
    except Exception as e:  # a constructor's own error that Hydra passed through
        raise UserError(
            f"model._target_={target!r} failed with model.kwargs={kwargs}: {one_line(e)}: "
            "fix model.kwargs to match its signature"
        ) from None
    if not isinstance(model, nn.Module):
        raise UserError(
            f"model._target_={target!r} returned {type(model).__name__}, not an nn.Module: "
            "point model._target_ at an nn.Module class or factory"
        )
    if m.loss_target == "model":  # forward(inputs, targets) returns the loss itself (nanoGPT, transformers)
        from .own_loss import OwnLossModel, own_loss

        return OwnLossModel(model), own_loss
    _logits_of_transformers(model)
    loss_fn = locate(m.loss_target, "model.loss_target") if m.loss_target else None
    return model, loss_fn


def _logits_of_transformers(model: nn.Module) -> None:
    """A ``transformers`` causal LM returns a ModelOutput: hand the runner its ``logits`` (as ``model=hf``)."""
    transformers = sys.modules.get("transformers")  # imported by the model's own module, if at all
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        model.config.use_cache = False
        model.register_forward_hook(lambda module, args, output: getattr(output, "logits", output))


@torch.no_grad()
def check_custom_output(model: nn.Module, loss_fn: Callable, batch: Any, m: Any, expected: str) -> None:
    """One eval-mode forward on a held-out ``batch``; refuse, in one line naming the expected output,
    a model without trainable parameters or an output its loss cannot use."""
    target = m._target_
    fix = f"make model._target_={target!r} return {expected}" + (
        ""
        if m.loss_target
        else " or pass model.loss_target=FN(output, targets), or model.loss_target=model when its "
        "forward(inputs, targets) computes the loss itself (nanoGPT's (logits, loss), a dict or .loss)"
    )
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"model._target_={target!r} has no trainable parameters: a custom model needs some to train")
    model.eval()
    out = None
    try:
        try:
            out = model(batch.inputs)
        except Exception as e:
            raise UserError(
                f"model._target_={target!r} failed on inputs of shape {tuple(batch.inputs.shape)} "
                f"({one_line(e, 200)}): {fix}"
            ) from None
        _refuse_wrong_shape(out, batch, m, expected, fix)
        loss = loss_fn(out, batch.targets)
        total = loss[0] if isinstance(loss, tuple) else loss
        if not (isinstance(total, torch.Tensor) and total.numel() == 1 and total.is_floating_point()):
            raise UserError(
                f"model.loss_target={m.loss_target!r} returned {type(total).__name__}, not a scalar "
                f"float tensor or (sum, count): fix the loss function"
            )
    except UserError:
        raise
    except Exception as e:
        raise _loss_error(e, out, tuple(batch.targets.shape), m, expected, fix) from None
    finally:
        model.train()
    check_custom_training(model, loss_fn, batch, m, expected, fix)


def _shape_of(out: Any) -> tuple | str:
    return tuple(out.shape) if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"


def _refuse_wrong_shape(out: Any, batch: Any, m: Any, expected: str, fix: str, training: bool = False) -> None:
    """Without a ``model.loss_target`` the output must be logits ``[*targets, VOCAB]`` (byte targets) or
    have the targets' shape; ``training``: the check of the training-mode forward."""
    if m.loss_target:
        return
    targets = batch.targets
    want = (*targets.shape, VOCAB) if targets.dtype == torch.long else tuple(targets.shape)
    got = _shape_of(out)
    if got != want:
        mode, again = (" in training mode (model.train())", " as in eval mode") if training else ("", "")
        raise UserError(
            f"model._target_={m._target_!r} returned {got}{mode} for inputs of shape "
            f"{tuple(batch.inputs.shape)}; expected {expected} = {want}{again}: {fix}"
        )


def _loss_error(e: BaseException, out: Any, targets: tuple, m: Any, expected: str, fix: str) -> UserError:
    """The loss raised: a ``model.loss_target``'s own error is the loss function's, else the output's."""
    if m.loss_target:
        got = _shape_of(out)
        return UserError(
            f"model.loss_target={m.loss_target!r} raised {one_line(e, 200)} (on the model's output "
            f"{got} and targets of shape {targets}): fix the loss function"
        )
    return UserError(
        f"model._target_={m._target_!r}: its output failed in the loss ({one_line(e, 200)}); expected {expected}: {fix}"
    )


def check_custom_training(model: nn.Module, loss_fn: Callable, batch: Any, m: Any, expected: str, fix: str) -> None:
    """One training-mode forward on ``batch`` (a model may differ there: dropout paths, a train-only
    branch): its output must have the eval-mode shape and its loss must reach the parameters (not
    detached from autograd). The RNG state, buffers (e.g. BatchNorm statistics) and gradients are
    restored, so training starts exactly as without the check."""
    target = m._target_
    rng, buffers = torch.get_rng_state(), [b.detach().clone() for b in model.buffers()]
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    model.train()
    try:
        with torch.enable_grad():
            out = model(batch.inputs)
            _refuse_wrong_shape(out, batch, m, expected, fix, training=True)
            loss = loss_fn(out, batch.targets)
            total = loss[0] if isinstance(loss, tuple) else loss
        if isinstance(total, torch.Tensor) and not total.requires_grad:
            raise UserError(
                f"model._target_={target!r}: in training mode its loss does not depend on its parameters (the "
                "output is detached from autograd, e.g. by .detach(), .item(), .numpy() or torch.no_grad()): "
                "return the output of its layers as computed"
            )
    except UserError:
        raise
    except Exception as e:
        raise UserError(
            f"model._target_={target!r} failed in training mode (model.train()) on inputs of shape "
            f"{tuple(batch.inputs.shape)} ({one_line(e, 200)}): {fix}"
        ) from None
    finally:
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers):
                b.copy_(saved)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        model.zero_grad(set_to_none=True)
