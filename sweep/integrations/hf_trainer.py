"""``ClipampCallback``: clipamp's per-step record and norm calibration inside an unmodified ``Trainer.train()``.

    from transformers import Trainer
    from sweep.integrations.hf_trainer import ClipampCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[ClipampCallback()])
    trainer.train()  # steps.csv + an MLflow run; the recommended max_grad_norm and its check

The calibration is the runner's (``sweep.integrations.recorder``): a 200-step window after the LR
warm-up and the norms' transient, τ aimed at the middle of the band with its interval, checked on
every later step. With ``apply=False`` (default) the run is bit-identical to the same run without
the callback (``docs/hf-trainer.md``).

One optimizer step of ``Trainer`` (transformers 5) and where the callback acts::

    backward × micro-batches → Trainer: unscale (fp16) + ‖g‖ [+ clip] → on_pre_optimizer_step
    → optimizer.step (fp16: GradScaler may skip) → on_optimizer_step → scheduler → zero_grad → on_step_end

- Clipping happens in Trainer between the last backward and ``on_pre_optimizer_step``, where no
  callback runs, and Trainer keeps the pre-clip norm to itself except in its logs. So the
  callback takes the clip over: from the first step's begin it sets ``args.max_grad_norm`` to
  ``NORM_ONLY_MAX_NORM`` (Trainer then only measures ‖g‖, multiplying a finite-norm gradient by
  exactly 1 and a non-finite one as your τ would, and logs it as ``grad_norm``) and in
  ``on_pre_optimizer_step`` clips them as Trainer would have: ``clip_grad_norm_(model.parameters(),
  max_grad_norm)`` on a finite norm — or, with ``apply=True``, at the policy's τ (your
  ``max_grad_norm`` until the window closes, the calibrated τ after). ``args`` is restored at train
  end; a ``train()`` cut short by an exception leaves it set, and the next ``train()`` still finds the
  user's τ (kept beside it on ``args``). ``grad_l2_pre_clip`` is therefore Trainer's own ``grad_norm``
  (NaN on a step whose norm is not finite); ``grad_l2_post_clip`` the norm the optimizer received.
- A schedule on the threshold: ``args.max_grad_norm`` set anew in ``on_step_begin`` of a callback before this
  one is the τ of that step on (the clip, the CSV's ``max_norm``); set any later in a step, Trainer has clipped
  with it before the callback measures, so that step is refused (``ValueError``) before its record, as is any
  change with ``apply=True`` (its clip is the policy's).
- Loss: the model's own loss (a forward hook; ``outputs.loss``, or ``outputs[0]`` of a tuple, where
  ``Trainer.compute_loss`` reads it), combined as Trainer combines it:
  summed over micro-batches when Trainer passes ``num_items_in_batch`` (then it is the token
  mean over the accumulated batch), else averaged. With a ``compute_loss_func`` or label
  smoothing the loss is computed outside the model: the column reads NaN. A ``compute_loss`` that adds
  terms or rescales the loss: the column is still the model's; one warning where Trainer's logged
  ``loss`` differs from it (``on_log``).
  ``token_count``: the labels ≠ -100 Trainer counts as ``num_items_in_batch`` (after the causal shift
  for a decoder-only LM, every label for a classifier or an encoder-decoder).
- Skips: under fp16 (CUDA) the GradScaler skips overflow steps (read from the optimizer) and
  ``scaler_scale`` is its scale (1.0 without a scaler). Under bf16/fp32 Trainer applies a
  non-finite gradient; ``skip_nonfinite=True`` (the default with ``apply=True``) drops the
  gradients so ``optimizer.step()`` changes nothing (the LR schedule still advances, as with
  Trainer's fp16 skips).
- Checkpoints: the callback is an ``ExportableState``; ``train(resume_from_checkpoint=…)``
  continues the calibration, the ``steps.csv`` and the MLflow run of the checkpoint
  (``docs/hf-trainer.md``, ``sweep.integrations.resume``).
- The run's ``dtype`` tag: what the forward computes in, read inside it at the first training forward
  (autocast's dtype where accelerate autocasts, else the weights'); until that step, and under ``torch_compile``
  (whose graph a hook would break), the arguments' (bf16/fp16/fp32).
- Not seen: the data source of a batch, per-micro-batch norms. Refused: DeepSpeed and FSDP
  (they clip inside their engines). Under DDP the gradients are all-reduced before the clip:
  every rank clips alike, rank 0 records (the loss and token count summed over the ranks, as Trainer logs them).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from clipamp_engine.spelling import Spelling

from .forward_dtype import ForwardDtype
from .hf_forward import loss_shifts_labels, model_loss, over_ranks
from .recorder import StepRecorder
from .resume import to_json, warn_fresh

#: ``args.max_grad_norm`` while the callback runs: ``Trainer`` then calls its clip at this τ, which
#: multiplies a gradient of finite norm by exactly 1 (τ / ‖g‖ ≥ 1, clamped) and one of inf norm by
#: 0, as any τ would (finite elements 0, infs NaN). ``max_grad_norm=0`` would make Trainer clip at
#: inf instead, and inf / inf is NaN: every gradient NaN. bf16's largest finite value, so that a
#: bf16 norm does not turn it into inf.
NORM_ONLY_MAX_NORM = float(torch.finfo(torch.bfloat16).max)
#: Where ``args`` keeps the user's ``max_grad_norm`` while the callback runs: a ``train()`` that an exception
#: (Ctrl-C in a notebook) cut short never reaches ``on_train_end``, and the next one must not take
#: ``NORM_ONLY_MAX_NORM`` for the user's τ.
_USER_MAX_GRAD_NORM = "_clipamp_user_max_grad_norm"
#: Where a ``train()``'s ``TrainerState`` (a new one per call, not saved: not a field) names the callback that
#: began it: a second one in the same ``train()`` would norm the gradients the first clipped.
_BEGUN_BY = "_clipamp_callback"
#: The advice's settings as a ``Trainer`` user writes them: ``TrainingArguments(max_grad_norm=, max_steps=)`` (or
#: ``num_train_epochs=``, which sets the length where ``max_steps`` does not) and the callback's own keywords
#: (``ClipampCallback(start=…, window=…)``).
HF_SPELLING = Spelling(threshold="max_grad_norm", length="max_steps|num_train_epochs", lengthen="raise")


class _NormOnly(float):
    """``NORM_ONLY_MAX_NORM`` as ``args.max_grad_norm`` while the callback runs, pickled as the user's τ: each
    checkpoint's ``training_args.bin`` (``torch.save(args)``) then holds the ``max_grad_norm`` the run was
    given, not a τ that clips nothing to whoever trains on from those arguments without the callback."""

    def __new__(cls, user_tau: float) -> _NormOnly:
        value = super().__new__(cls, NORM_ONLY_MAX_NORM)
        value.user_tau = user_tau
        return value

    def __reduce__(self):
        return float, (self.user_tau,)

    def __copy__(self) -> _NormOnly:
        return self

    def __deepcopy__(self, memo) -> _NormOnly:
        return self


class ClipampCallback(TrainerCallback, ExportableState):
    """Record every optimizer step of ``Trainer``; calibrate τ as the runner does; clip at it if asked.

    Each checkpoint ``Trainer`` saves holds the callback's state (``state()``, in
    ``trainer_state.json``); ``train(resume_from_checkpoint=…)`` continues from it: the calibration,
    the same ``steps.csv`` and the same MLflow run (``sweep.integrations.resume``).

    Args:
        apply: clip at the calibrated τ once the window closes (else keep ``args.max_grad_norm``:
            the run is unchanged).
        csv_path: where ``steps.csv`` goes without MLflow (default ``<output_dir>/clipamp/steps.csv``).
        tracking: ``"auto"``: an MLflow run (a child of the active run, if any: ``report_to="mlflow"``'s)
            in ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlruns/mlflow.db``; a tracking URI; ``None``: CSV only.
        experiment: the MLflow experiment (``None``: the active run's when nested under one, else ``clipamp``).
        run_name: the MLflow run name.
        skip_nonfinite: refuse an update whose gradient norm is inf/NaN (default: ``apply``).
        verbose: print the CSV path, the recommendation and the verdict.
        **calibrate: overrides of the runner's calibration (``window``, ``start``, ``quantile``,
            ``every``, ``validate``, ``candidates``, ``target_clip``, ``confidence``; see
            ``clipamp_engine.clip.calibrated.RECOMMENDED``).
    """

    def __init__(
        self,
        *,
        apply: bool = False,
        csv_path: str | Path | None = None,
        tracking: str | None = "auto",
        experiment: str | None = None,
        run_name: str | None = None,
        skip_nonfinite: bool | None = None,
        verbose: bool = True,
        **calibrate: Any,
    ) -> None:
        settings = dict(
            apply=apply,
            csv_path=csv_path,
            tracking=tracking,
            experiment=experiment,
            run_name=run_name,
            skip_nonfinite=skip_nonfinite,
            verbose=verbose,
        )
        self.recorder = StepRecorder(calibrate=calibrate, spelling=HF_SPELLING, **settings)
        self.apply = apply
        #: The constructor's arguments, as JSON: ``Trainer(restore_callback_states_from_checkpoint=True)``
        #: builds the callback it resumes with from them.
        self.init_args = {k: to_json(v) for k, v in {**settings, **calibrate}.items()}
        self._hook = self._args = self._model = self._dtype = None
        self._user_tau, self._norm_only = 0.0, False
        self._unlogged: list[float] = []  # the recorded losses of the steps Trainer has not logged yet
        self._loss_warned = False  # this train() said its logged loss differs from the recorded one

    @property
    def policy(self):
        return self.recorder.policy

    @property
    def summary(self):
        return self.recorder.summary

    @property
    def tau(self) -> float | None:
        return self.recorder.clip_in_force()

    @property
    def tracker(self):
        return self.recorder.tracker

    # -- checkpoint ----------------------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint keeps (``ExportableState``), as JSON: the constructor's arguments and the
        recorder's state at the step saved."""
        return {"args": self.init_args, "attributes": {"checkpoint": self.recorder.checkpoint_state()}}

    def _saved(self, state) -> dict | None:
        """The recorder state of the checkpoint ``train()`` resumes from (``state.global_step`` > 0)."""
        saved = state.stateful_callbacks.get(type(self).__name__)
        if saved is None:  # Trainer's next save updates this callback's entry: the checkpoint must hold one
            state.stateful_callbacks[type(self).__name__] = self.state()
        if isinstance(saved, list):
            why = "holds the states of several ClipampCallbacks"
        elif not isinstance(saved, dict) or "checkpoint" not in saved.get("attributes", {}):
            why = "holds no ClipampCallback state (it was saved without the callback)"
        else:
            return saved["attributes"]["checkpoint"]
        warn_fresh(state.global_step, why)
        return None

    # -- train begin / end ---------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        first = getattr(state, _BEGUN_BY, None)
        if first is not None:  # added twice: refused before any step, the first one undone
            first._undo(args)
            raise ValueError(
                f"the Trainer holds {'this ClipampCallback twice' if first is self else 'two ClipampCallbacks'}: "
                "each would clip every step, the second measuring the gradients the first clipped; keep one "
                "(Trainer(callbacks=[…]) and trainer.add_callback each add one)"
            )
        setattr(state, _BEGUN_BY, self)
        if args.deepspeed or args.fsdp:
            raise ValueError(
                "ClipampCallback does not support DeepSpeed or FSDP (they clip inside their engines); "
                "run without them, or drop the callback"
            )
        user_tau = args.max_grad_norm
        if user_tau == NORM_ONLY_MAX_NORM:  # a train() that an exception cut short left it so: the user's τ
            user_tau = getattr(args, _USER_MAX_GRAD_NORM, self._user_tau)
            args.max_grad_norm = user_tau  # until the first step
        self._args, self._user_tau, self._model = args, user_tau, model
        # else Trainer clips nothing and its norm pass stays as it is; set at the first step's begin, so that a
        # callback after this one that logs args at train begin (MLflowCallback, TensorBoardCallback) logs the user's
        self._norm_only = self.apply or self._user_tau > 0
        if self._norm_only:
            setattr(args, _USER_MAX_GRAD_NORM, user_tau)  # for a later callback on the same args
        self._unhook()  # hooks left by a train() cut short: one per forward
        # the dtype the arguments ask for, until the first forward shows the one it runs in (on_step_end)
        dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        try:
            self.recorder.begin(
                resume=self._saved(state) if state.global_step > 0 else None,
                total_steps=state.max_steps if state.max_steps > 0 else None,
                user_tau=self._user_tau,
                default_csv=Path(args.output_dir) / "clipamp" / "steps.csv",
                main_process=state.is_world_process_zero,
                tags={"run": "trainer", "dtype": dtype, "model": type(model).__name__, "device": args.device.type},
                params={
                    **{f"calibrate.{k}": v for k, v in self.recorder.options.items() if k != "cap"},
                    "apply": self.apply,
                    "max_grad_norm": self._user_tau,
                    "learning_rate": args.learning_rate,
                    "per_device_train_batch_size": args.per_device_train_batch_size,
                    "gradient_accumulation_steps": args.gradient_accumulation_steps,
                },
            )
        except BaseException:  # a refused resume: args as the user left them
            args.max_grad_norm = self._user_tau
            raise
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        compiled = args.torch_compile or hasattr(model, "_orig_mod")  # hooks there would split the compiled graph
        self._dtype = None if compiled else ForwardDtype(model, args.device.type)
        self._shifts_labels = loss_shifts_labels(model)
        self._unlogged, self._loss_warned = [], False
        self._reset()

    def on_train_end(self, args, state, control, **kwargs):
        args.max_grad_norm = self._user_tau
        self._unhook()
        self.recorder.end(state.global_step)

    def _unhook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._dtype is not None:
            self._dtype.remove()

    def _undo(self, args) -> None:
        """Undo ``on_train_begin`` of a ``train()`` refused before its first step: ``args`` as the user left
        them, no hook, the CSV closed and the MLflow run ended as FAILED."""
        args.max_grad_norm = self._user_tau
        self._unhook()
        self.recorder.abort("FAILED")

    # -- one optimizer step --------------------------------------------------------------------
    def _reset(self) -> None:
        self._loss = self._tokens = None
        self._micro, self._loss_is_sum = 0, False

    def on_step_begin(self, args, state, control, **kwargs):
        tau = args.max_grad_norm
        if not isinstance(tau, _NormOnly) and tau != self._user_tau:  # set since the last step: a τ schedule
            self._take_new_tau(args, state, tau)
        if self._norm_only and not isinstance(args.max_grad_norm, _NormOnly):  # the user's τ: the first step, or new
            args.max_grad_norm = _NormOnly(self._user_tau)  # Trainer measures ‖g‖; the clip: on_pre_optimizer_step
        self._step_tau = args.max_grad_norm  # what Trainer's clip must find
        self._reset()

    def _take_new_tau(self, args, state, tau: float) -> None:
        """``args.max_grad_norm`` set anew before this step's ``on_step_begin`` (a callback before this one that
        schedules the threshold): the clip and the CSV's ``max_norm`` follow it from this step on. Refused with
        ``apply=True``, whose clip is the policy's."""
        if self.apply:
            self._refuse(
                f"args.max_grad_norm was changed from {self._user_tau} to {tau} before step {state.global_step + 1}, "
                "and ClipampCallback(apply=True) clips at its own τ (your max_grad_norm only until the calibration "
                "window closes), so the new value would never be applied; drop the change, or use apply=False to "
                "clip at your schedule and record the norms under it"
            )
        self._user_tau, self._norm_only = tau, tau > 0
        self.recorder.set_user_tau(tau)
        setattr(args, _USER_MAX_GRAD_NORM, tau)

    def _refuse(self, why: str) -> None:
        """End the run (FAILED, the steps before this one recorded) and raise ``why``; ``args`` as the user set them."""
        self._unhook()
        self.recorder.abort("FAILED")
        raise ValueError(f"clipamp: {why}")

    def _on_forward(self, module, args, kwargs, output) -> None:
        if not module.training:
            return  # evaluation forwards
        self._micro += 1
        loss = model_loss(output)
        if loss is not None:
            self._loss = loss.detach().float() + (0 if self._loss is None else self._loss)
        self._loss_is_sum = "num_items_in_batch" in kwargs
        shifted = kwargs.get("shift_labels")
        labels = shifted if shifted is not None else kwargs.get("labels")
        if torch.is_tensor(labels):
            counted = labels[..., 1:] if shifted is None and self._shifts_labels else labels
            n = (counted != -100).sum()
            self._tokens = n if self._tokens is None else self._tokens + n

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        """Unscaled, accumulated, not yet clipped gradients: norm over ``model.parameters()`` as Trainer
        does, clip as Trainer would (or at the policy's τ), read everything back once."""
        if args.max_grad_norm != self._step_tau:  # set since on_step_begin: Trainer's clip has already used it
            self._refuse(
                f"args.max_grad_norm was changed to {args.max_grad_norm} during step {state.global_step + 1}, after "
                "ClipampCallback.on_step_begin: Trainer clipped with the new value before the callback measured the "
                "gradients, so it would record clipped norms as pre-clip ones; change max_grad_norm in on_step_begin "
                "of a callback placed before ClipampCallback (Trainer(callbacks=[your_callback, ClipampCallback()])): "
                "the callback then records the norms before the clip and clips at your value"
            )
        scaler = getattr(optimizer, "scaler", None)
        self._has_scaler = scaler is not None and scaler.is_enabled()
        self._scale = float(scaler.get_scale()) if self._has_scaler else 1.0  # sync (CUDA fp16): this step's scale
        self._lr = float(optimizer.param_groups[0]["lr"])
        params = list(self._model.parameters())  # what Trainer's clip_grad_norm_ norms, in its order
        loss = None if self._loss is None else self._loss / (1 if self._loss_is_sum else max(self._micro, 1))
        loss, self._tokens = over_ranks(loss, self._tokens, self._loss_is_sum)
        self._measured = self.recorder.measure(
            params,
            state.global_step + 1,
            host_clips=False,
            after_host_pass=args.max_grad_norm == NORM_ONLY_MAX_NORM,
            loss=loss,
            tokens=self._tokens,
        )

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self._skipped = bool(getattr(optimizer, "step_was_skipped", False))

    def on_step_end(self, args, state, control, **kwargs):
        if self._dtype is not None and self._dtype.tag(self.recorder.tracker):  # the first forward showed its dtype
            self._dtype = None
        self.recorder.record(state.global_step, self._lr, self._measured, scale=self._scale, skipped=self._skipped)
        self._unlogged.append(self._measured.loss)

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Trainer's logged ``loss`` (the mean of what ``compute_loss`` returned over the steps since its last log)
        against the model's own loss the CSV recorded for them: one warning per ``train()`` where they differ (a
        ``compute_loss`` that adds terms to the model's loss or rescales it)."""
        logged = (logs or {}).get("loss")
        if logged is None:  # an evaluation's log, or the end of train()'s summary
            return
        ours, self._unlogged = self._unlogged, []
        if not ours or self._loss_warned or not state.is_world_process_zero:
            return
        mean = math.fsum(ours) / len(ours)
        if not (math.isfinite(logged) and math.isfinite(mean)):  # NaN: no model loss, or Trainer's nan/inf filter
            return
        if not math.isclose(logged, mean, rel_tol=1e-3, abs_tol=1e-6):
            self._loss_warned = True
            first = state.global_step - len(ours) + 1
            warnings.warn(
                f"clipamp: Trainer logged loss {logged:.6g} for steps {first}–{state.global_step}, and the model's own "
                f"loss (outputs.loss), which the steps.csv loss column records, averages {mean:.6g} over them: the "
                "loss trained on is not the model's (a compute_loss that adds terms to it or rescales it); the norms, "
                "the calibration and the clip are unaffected",
                UserWarning,
                stacklevel=2,
            )
