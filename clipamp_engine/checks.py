"""Misuse of ``AmpTrainState`` caught with a ``ValueError`` that names the argument and the fix,
instead of a step that silently trains nothing or an error from deep inside (``torch.stack``,
a division by zero, an ``AttributeError`` on a float).

The checks read Python objects and tensor metadata only (types, shapes, ``numel``): no device sync.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections import Counter
from typing import Any

import torch
from torch import nn

from .scaling import LossScaler
from .warn import warn


def check_arguments(model_device: str, device_type: Any, dtype: str, accumulation_steps: Any, scaler: Any) -> None:
    """At construction: the arguments agree with each other and with the model's device."""
    if device_type is not None and device_type != model_device:
        raise ValueError(
            f"device_type={device_type!r} disagrees with the model's parameters on {model_device!r}: "
            f"autocast must run on the optimizer's device (pass device_type={model_device!r} or move the model)"
        )
    if dtype != "fp32" and not torch.amp.is_autocast_available(model_device):
        raise ValueError(f"dtype={dtype!r}: autocast is not available on device {model_device!r}; use dtype='fp32'")
    if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps={accumulation_steps!r} must be an integer >= 1")
    if scaler is not None and not isinstance(scaler, LossScaler):
        carry = (
            f"; to carry this {type(scaler).__name__}'s scale, load its state: "
            "LossScaler(device, ...).load_state_dict(grad_scaler.state_dict())"
            if isinstance(scaler, torch.amp.GradScaler)
            else ""
        )
        raise ValueError(
            f"scaler={type(scaler).__name__} must be a clipamp_engine.LossScaler (a GradScaler that can back off on "
            f"refused losses), e.g. LossScaler({model_device!r}, init_scale=2.0**16, growth_interval=2000){carry}"
        )
    scaler_device = getattr(scaler, "_device", model_device)  # GradScaler's device argument
    if torch.device(scaler_device).type != model_device:
        name = type(scaler).__name__
        raise ValueError(
            f"scaler={name}({scaler_device!r}, ...) is for another device than the model's parameters on "
            f"{model_device!r} (torch disables a GradScaler whose device it cannot use, so fp16 would train "
            f"unscaled): build it with {name}({model_device!r}, ...)"
        )


def check_sharding(world_kind: str, clip: Any, forensics: bool, whole_param_modes: list[str]) -> None:
    """At construction: FSDP2 keeps no whole parameters, which some clip modes and forensics read."""
    if world_kind != "fsdp2":
        return
    unsharded = "needs whole (unsharded) parameters, which FSDP2 does not keep: use DDP"
    if clip.needs_whole_params:
        also = "; forensics needs them too: pass forensics=None" if forensics else ""
        raise ValueError(
            f"clip mode {clip.mode!r} {unsharded}, or a clip mode other than {', '.join(whole_param_modes)}{also}"
        )
    if forensics:
        raise ValueError(f"forensics {unsharded}, or turn forensics off (forensics=None)")


def check_setup(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Any,
    max_norm: Any,
    clip: Any,
    clip_window: Any,
    unknown: dict[str, Any],
) -> None:
    """At construction: no keyword argument ``AmpTrainState`` does not take (``TypeError``); ``model`` is a
    module, ``optimizer`` an optimizer and ``loss_fn`` callable (or ``None``), ``max_norm`` a number > 0
    (when the default policy uses it), ``clip`` a policy object, ``clip_window`` a step count, and the
    optimizer steps without a closure (LBFGS needs one) and updates at least one of ``model``'s
    parameters. Warns when some of the model's trainable parameters are not the optimizer's: their
    gradients are computed, never applied, never zeroed, and not normed."""
    if unknown:
        raise TypeError(unknown_arguments_message(unknown))
    _check_types(model, optimizer, loss_fn)
    if clip is None and (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or math.isnan(max_norm)):
        raise ValueError(
            f"max_norm={max_norm!r} must be a number > 0 (a float such as 1.0; math.inf never clips), "
            f"not {type(max_norm).__name__}"
        )
    if clip is None and not max_norm > 0:
        raise ValueError(
            f"max_norm={max_norm!r} must be > 0; to train without clipping pass clip=NoClip() "
            "(from clipamp_engine import NoClip)"
        )
    from .clip.base import ClipPolicy  # here: the clip package imports this module

    if clip is not None and not isinstance(clip, ClipPolicy):
        named = f"make_clip_policy({clip!r}, ...)" if isinstance(clip, str) else "make_clip_policy(mode, ...)"
        raise ValueError(f"clip={clip!r} is not a clip policy: pass {named} or a policy such as GlobalNormClip(1.0)")
    if isinstance(clip_window, bool) or not isinstance(clip_window, int) or clip_window < 1:
        raise ValueError(f"clip_window={clip_window!r} must be a number of steps >= 1 (the clipping-ratio window)")
    # the class's step (an LR scheduler wraps the instance's in a function of the unbound one), less ``self``
    needs = _required_positionals(getattr(type(optimizer), "step", None))[1:]
    if needs:
        raise ValueError(
            f"{type(optimizer).__name__}.step() needs an argument ({', '.join(needs)}): it re-evaluates the loss "
            "several times per update, and AmpTrainState runs one forward and backward per step and then calls "
            "optimizer.step() with none; use a first-order optimizer (SGD, AdamW, ...) or step this one in a loop "
            "of your own without AmpTrainState"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if not held & {id(p) for p in model.parameters()}:
        raise ValueError(
            f"the optimizer holds {len(held)} parameter tensor(s), none of them the model's: every step would "
            "update nothing; build it from this model, e.g. torch.optim.AdamW(model.parameters())"
        )
    left = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if left:
        warn(
            f"{len(left)} of the model's parameter tensors require grad but the optimizer does not hold them "
            f"({', '.join(left[:3])}{', ...' if len(left) > 3 else ''}): the step computes their gradients, never "
            "applies or zeroes them, and leaves them out of the clipped norm (clip_grad_norm_(model.parameters()) "
            "would count them); freeze them with p.requires_grad_(False), or give them to the optimizer",
            UserWarning,
        )


def _check_types(model: Any, optimizer: Any, loss_fn: Any) -> None:
    """The three positional arguments are what their names say (swapped ones fail here, not deep inside)."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model is a {type(model).__name__}, not a torch.nn.Module: call AmpTrainState(model, optimizer, loss_fn)"
        )
    if not isinstance(getattr(optimizer, "param_groups", None), list) or not callable(getattr(optimizer, "step", None)):
        raise ValueError(
            f"optimizer is a {type(optimizer).__name__}, not an optimizer (param_groups and step()): call "
            "AmpTrainState(model, optimizer, loss_fn)"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(
            f"loss_fn={loss_fn!r} is not callable: pass a function of (output, targets) such as "
            "torch.nn.functional.cross_entropy, or loss_fn=None for a model that computes its own loss; dtype, "
            "max_norm and the other settings are keyword arguments (dtype='bf16')"
        )


def check_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """At construction: the step calls ``scheduler.step()`` with no argument, after each taken update, so the
    scheduler must be of this optimizer and step without a metric (``ReduceLROnPlateau`` needs one)."""
    if scheduler is None:
        return
    name = type(scheduler).__name__
    step = getattr(scheduler, "step", None)
    if not callable(step) or _required_positionals(step):
        raise ValueError(
            f"scheduler={name}: its step() needs an argument (a metric such as the validation loss), and the "
            f"engine steps the scheduler with none after each taken update; pass scheduler=None and call "
            f"{name}.step(metric) yourself after each evaluation"
        )
    own = getattr(scheduler, "optimizer", optimizer)
    if own is not optimizer:
        raise ValueError(
            f"scheduler={name} schedules another optimizer ({type(own).__name__} at {id(own):#x}), not the one "
            "the step updates: build it from the same optimizer you pass to AmpTrainState"
        )


def dtype_hint(dtype: Any, choices: dict[str, torch.dtype]) -> str:
    """``": pass dtype='bf16'"`` for a dtype given in another spelling (nanoGPT's ``"bfloat16"``,
    ``torch.bfloat16``, ``"BF16"``), else ``""``."""
    for name, value in choices.items():
        if str(dtype) in (str(value), str(value).removeprefix("torch.")) or str(dtype).lower() == name:
            return f": pass dtype={name!r}"
    return ""


def scheduler_mark(scheduler: Any) -> tuple[int, Any] | None:
    """Which scheduler the state holds and its ``last_epoch`` (``None`` without one)."""
    return None if scheduler is None else (id(scheduler), getattr(scheduler, "last_epoch", None))


def check_scheduler_untouched(scheduler: Any, seen: tuple[int, Any] | None) -> None:
    """Before a step: the scheduler is where the state left it. A loop that also calls ``scheduler.step()``
    (a habit kept when adopting ``AmpTrainState(scheduler=...)``) runs the schedule twice as fast, and a
    scheduler restored behind the state's back is not followed by the fused path's device schedule.
    One swapped in (``state.scheduler = ...``, ``None`` to drop it) is the user's to place."""
    now = scheduler_mark(scheduler)
    if now is not None and seen is not None and now[0] == seen[0] and now[1] != seen[1]:
        raise ValueError(
            f"scheduler={type(scheduler).__name__} was stepped or restored outside AmpTrainState (last_epoch "
            f"{now[1]}, the state left it at {seen[1]}): the state steps it after each taken update, so drop your "
            "scheduler.step() (or pass scheduler=None and step it yourself), and restore it before building "
            "the state or through state.load_state_dict"
        )


def _required_positionals(fn: Any) -> list[str]:
    """The positional parameters of ``fn`` without a default (an unreadable signature counts as none)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty]


#: ``GradScaler`` settings ``AmpTrainState`` does not take: they belong to the scaler.
SCALER_SETTINGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


def unknown_arguments_message(unknown: dict[str, Any]) -> str:
    """The ``TypeError`` message for keyword arguments ``AmpTrainState`` does not take."""
    settings = [k for k in unknown if k in SCALER_SETTINGS]
    if settings:
        given = ", ".join(f"{k}={unknown[k]!r}" for k in settings)
        return (
            f"AmpTrainState takes loss-scale settings through scaler=, not {', '.join(settings)}: "
            f"pass scaler=LossScaler(device, {given}) (or HysteresisScaler)"
        )
    return f"AmpTrainState got unexpected keyword arguments: {', '.join(sorted(unknown))}"


def check_scheduler_groups(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """After ``add_param_group``: a scheduler built for fewer groups cannot step them (torch's ``step()`` raises
    after the optimizer has updated), so the step refuses before it runs anything."""
    built_for, groups = len(getattr(scheduler, "base_lrs", optimizer.param_groups)), len(optimizer.param_groups)
    if built_for != groups:
        raise ValueError(
            f"the optimizer now has {groups} param groups and its scheduler ({type(scheduler).__name__}) was "
            f"built for {built_for}: torch's schedulers step only the groups they were built with (their step() "
            "raises); add every group before building the scheduler (a frozen one with lr=0, say), or pass "
            "scheduler=None and step the schedule yourself"
        )


def model_device_type(model: nn.Module) -> str:
    """The one device type of ``model``'s parameters; ``ValueError`` if they live on several or none."""
    types = {p.device.type for p in model.parameters()}
    if len(types) != 1:
        raise ValueError(f"model parameters live on {sorted(types) or 'no device'}: expected exactly one device type")
    return types.pop()


def check_accumulation(batch_size: int, accumulation_steps: int) -> None:
    """Each of the ``accumulation_steps`` micro-batches needs at least one sample."""
    if batch_size < accumulation_steps:
        raise ValueError(
            f"accumulation_steps={accumulation_steps} is larger than the batch ({batch_size} samples): some "
            f"micro-batches would be empty; pass accumulation_steps <= {batch_size} or a larger batch"
        )


def checked_loss(result: Any) -> Any:
    """``loss_fn``'s result as the step uses it: a scalar floating tensor, or ``(loss_sum, token_count)``
    with a count ≥ 0 (a micro-batch may hold no token; the batch must hold one, which the step checks
    after its last micro-batch: a ``ValueError``, or on the fused path for a tensor count, which it
    cannot read without a sync, a 0/0 token mean skipped as ``nonfinite_loss``); ``ValueError``
    naming what it returned otherwise."""
    if result is None:  # the usual adapter for a model that computes its own loss, called without targets
        raise ValueError(
            "loss_fn returned None: expected a loss tensor or (loss_sum, token_count); for a model that computes "
            "its own loss from the targets pass loss_fn=None (the step then calls model(inputs, targets))"
        )
    if isinstance(result, (tuple, list)):
        if len(result) != 2:
            raise ValueError(
                f"loss_fn returned a {type(result).__name__} of {len(result)} items: return a scalar mean loss "
                "or (loss_sum, token_count)"
            )
        loss, count = result
        if isinstance(count, (int, float)) and not count >= 0:
            raise ValueError(
                f"loss_fn returned (loss_sum, {count!r}): the token count must be >= 0 in a micro-batch and > 0 "
                "over the batch; return the number of tokens the sum is over"
            )
        _check_scalar(loss, "loss_fn's loss_sum")
        return tuple(result)
    _check_scalar(result, "loss_fn")
    return result


def _check_scalar(loss: Any, what: str) -> None:
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"{what} returned a {type(loss).__name__} ({loss!r}), not a tensor: return the torch scalar computed "
            "from the model's output (a Python number carries no gradient)"
        )
    if loss.numel() != 1 or not loss.is_floating_point():
        raise ValueError(
            f"{what} returned a {loss.dtype} tensor of shape {tuple(loss.shape)}, not a floating scalar: reduce "
            "it (e.g. .mean(), or reduction='mean')"
        )


def check_calibrator_options(quantile: float, candidates: Any, confidence: Any) -> None:
    """A calibration window's options, refused when the policy is built (not when its window closes).

    ``candidates`` is a set of thresholds in any order; none (``[]``) is a set too: the window then reports the
    clipping ratio at its quantiles and τ only. A threshold listed twice says nothing more and is refused."""
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile={quantile!r} must be in (0, 1), e.g. 0.95")
    if not (is_number(confidence) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence={confidence!r} must be in (0, 1), e.g. 0.95 (the intervals' level)")
    if not all(is_number(c) and 0.0 < c < math.inf for c in candidates):
        raise ValueError(
            f"candidates={list(candidates)!r} must be finite numbers > 0 (fixed thresholds whose clipping "
            "ratio the window reports)"
        )
    twice = sorted(c for c, n in Counter(map(float, candidates)).items() if n > 1)
    if twice:
        raise ValueError(
            f"candidates={list(candidates)!r} lists {', '.join(f'{c:g}' for c in twice)} more than once: each is one "
            "threshold whose clipping ratio the window reports, so drop the repeat"
        )


def check_checkpoint_fits(state: dict[str, Any], dtype: str, scheduled: bool, clip: Any = None) -> None:
    """``AmpTrainState.load_state_dict``: a checkpoint of another dtype, or with a schedule where the
    state has none (or the reverse), would drop or invent a loss scale or a schedule; one that lacks
    the state's own entries (another loop's: nanoGPT's ``model``, ``optimizer``, ``iter_num``), or whose
    clip state is another policy's (``check_clip_state_fits``), is refused before anything loads."""
    missing = [k for k in ("scaler", "clip", "skip_monitor", "clip_monitor", "step_count") if k not in state]
    if missing:
        raise ValueError(
            f"the checkpoint has no {', '.join(missing)} entries: it was not saved from AmpTrainState.state_dict() "
            "(nothing was loaded); save state.state_dict() in checkpoints, or load a model-only checkpoint with "
            "model.load_state_dict and optimizer.load_state_dict before building the AmpTrainState"
        )
    saved = state.get("dtype", dtype)
    if saved != dtype:
        raise ValueError(
            f"the checkpoint is of a dtype={saved!r} run and this AmpTrainState has dtype={dtype!r}: "
            f"build it with dtype={saved!r} to resume that run"
        )
    if (state.get("scheduler") is None) == scheduled:
        has = "has no" if state.get("scheduler") is None else "has a"
        raise ValueError(
            f"the checkpoint {has} LR scheduler state and this AmpTrainState "
            f"{'has a' if scheduled else 'has no'} scheduler: build it as the run was built"
        )
    if clip is not None:
        check_clip_state_fits(state["clip"], clip)


def check_clip_state_fits(saved: Any, clip: Any) -> None:
    """A clip state saved by another policy: a stateful policy's (AutoClip's history, a calibrated
    window and its τ, DP-SGD's noise generator) would be dropped silently by a policy that keeps none,
    or fail deep inside ``load_state_dict`` (a ``KeyError``) after the model had been loaded."""
    own = set(clip.state_dict())
    saved_keys = set(saved) if isinstance(saved, dict) else set()
    foreign = sorted(saved_keys - own)
    if foreign or (own and not saved_keys):
        held = f"state {', '.join(foreign)}" if foreign else "no state"
        raise ValueError(
            f"the checkpoint's clip policy holds {held}, which this AmpTrainState's clip={clip.mode!r} "
            f"({type(clip).__name__}) {'does not keep' if foreign else 'needs'}: it was saved by another clip "
            "mode (nothing was loaded); build the AmpTrainState with the clip policy the run was saved with"
        )


def is_number(x: object) -> bool:
    """A real number (numpy's included), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_window_options(window: Any, every: Any, total_steps: Any, first: Any) -> None:
    """``CalibrationWindows``' arguments: one ``ValueError`` naming the first that is out of range."""
    if not _is_int(window) or window < 2:
        raise ValueError(f"window={window!r} must be an integer >= 2 steps")
    if not _is_int(every) or every < 0 or (every and every < window):
        raise ValueError(f"every={every!r} must be 0 (one window) or an integer >= window={window}")
    if total_steps is not None and (not _is_int(total_steps) or total_steps < 1):
        raise ValueError(f"total_steps={total_steps!r} must be an integer >= 1 (or None: unknown)")
    if not _is_int(first) or first < 1:
        raise ValueError(f"first={first!r} must be a step number >= 1")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
