"""``ClipampCallback`` for Lightning: clipamp's per-step record and norm calibration in ``Trainer.fit()``.

    import lightning as L
    from sweep.integrations.lightning import ClipampCallback

    trainer = L.Trainer(gradient_clip_val=1.0, callbacks=[ClipampCallback()])
    trainer.fit(module, loader)  # steps.csv + an MLflow run; the recommended gradient_clip_val and its check

The calibration is the runner's (``sweep.integrations.recorder``); with ``apply=False`` (default)
the run is bit-identical to the same run without the callback (``docs/lightning.md``).

One optimizer step of Lightning (2.x, automatic optimization) and where the callback acts::

    training_step + backward × accumulate_grad_batches → precision plugin: unscale (fp16)
    → on_before_optimizer_step (callback) → configure_gradient_clipping (Lightning clips
    main_params(optimizer) at gradient_clip_val) → optimizer.step → LR scheduler → on_train_batch_end

- The callback norms the gradients in ``on_before_optimizer_step``, where they are unscaled,
  accumulated and not yet clipped, over the parameters Lightning clips and in its order
  (``trainer.precision_plugin.main_params(optimizer)``: the optimizer's param groups).
  ``apply=False``: Lightning then clips as it always does; ``grad_l2_pre_clip`` is the norm its
  ``clip_grad_norm_`` computes. ``apply=True``: Lightning clips at the policy's τ (your
  ``gradient_clip_val`` until the window closes, the calibrated τ after), which the callback sets
  as ``trainer.gradient_clip_val`` at each step (yours restored at the fit's end): the clip still
  runs after every ``on_before_optimizer_step`` hook, the module's own (a ``grad_norm`` log) included.
- Manual optimization: ``on_before_optimizer_step`` runs inside ``opt.step()``, after your
  ``manual_backward``; Lightning does not clip there, so pass ``max_norm=`` and do not call
  ``self.clip_gradients`` yourself: the callback clips at it as that call would (throughout with
  ``apply=False``, until the window closes with ``apply=True``); a ``self.clip_gradients`` call that clips
  before ``opt.step()`` is refused there (the norms would be post-clip). A step's loss is the mean of the
  ``loss`` of the batches since the previous ``opt.step()`` (manual accumulation: every N batches);
  each of several ``opt.step()`` in a batch is recorded, the earlier ones with a NaN loss.
  One optimizer only: a fit with more (a GAN's two) is refused when it starts, since one
  calibration window would mix the norms of different networks.
- Loss: the mean of the ``loss`` of ``training_step``'s output over the micro-batches the step
  accumulated (Lightning divides each by ``accumulate_grad_batches``, also on the shorter last step
  of an epoch: the callback divides by the micro-batches run). Norm-based clipping only
  (``gradient_clip_algorithm="norm"``).
- Run length (where ``start="auto"`` places the window): ``trainer.estimated_stepping_batches``,
  ``max_steps`` or ``max_epochs``, whichever ends the fit first; unknown (``None``) without either.
  Under a ``GradientAccumulationScheduler`` each epoch's steps at that epoch's accumulation (Lightning's
  estimate takes the factor in force when the fit starts, 1, for every epoch).
- Skips: under ``16-mixed`` the precision plugin's GradScaler skips ``optimizer.step()`` on an
  inf/NaN gradient and backs its scale off; a step after which the scale is lower is recorded
  skipped (``nonfinite_grad``), ``scaler_scale`` being the scale it ran at (1.0 without a scaler).
- A step whose ``training_step`` returned ``None`` for every micro-batch (automatic optimization): Lightning
  counts it (``global_step`` and the LR schedule advance) but runs no backward, so the optimizer changes
  nothing; recorded skipped (``no_loss``, its norms NaN), out of the calibration window.
- Checkpoints: the callback's ``state_dict`` (the recorder's state at the step saved) goes into
  every checkpoint; ``fit(ckpt_path=…)`` restores it before ``on_train_start``, where the record
  opens, and the calibration, the ``steps.csv`` and the MLflow run continue from it
  (``sweep.integrations.resume``). ``trainer.fit()`` again on the same trainer and callback continues from
  where the last fit ended, as from a checkpoint there.
- A fit an exception ends (Ctrl-C, an error; ``on_exception``) gets its ``gradient_clip_val`` back,
  its CSV closed and its MLflow run ended as KILLED (``KeyboardInterrupt``) or FAILED.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler

from clipamp_engine.spelling import Spelling

from ..tracking.tracker import ended_as
from .forward_dtype import ForwardDtype
from .recorder import StepRecorder
from .resume import warn_fresh

#: Lightning's precision settings as the dtype the forward runs in (its ``16-mixed`` is refused on a CPU).
PRECISION_DTYPES = {
    "16-mixed": "fp16",
    "bf16-mixed": "bf16",
    "16-true": "fp16",
    "bf16-true": "bf16",
    "32-true": "fp32",
    "64-true": "fp64",
}
#: The advice's settings as a Lightning user writes them: ``Trainer(gradient_clip_val=, max_steps=)`` and the
#: callback's own keywords (``ClipampCallback(start=…, window=…)``); a fit its epochs end says ``max_epochs=``
#: (``length_spelling``).
LIGHTNING_SPELLING = Spelling(threshold="gradient_clip_val", length="max_steps", lengthen="raise")
#: Under manual optimization, where the user's τ is ``ClipampCallback(max_norm=)`` (Lightning's clip does not run).
MANUAL_SPELLING = Spelling(threshold="max_norm", length="max_steps", lengthen="raise")


def length_spelling(spelling: Spelling, trainer: pl.Trainer, total: float) -> Spelling:
    """``spelling`` with the ``Trainer`` argument that ends a fit of ``total`` steps as its length:
    ``max_epochs`` where the epochs end it first (no ``max_steps``, or more than the epochs take), since a
    higher ``max_steps`` would not lengthen that fit; else ``max_steps``, also the one way to give a length to
    a fit Lightning cannot count (``total`` inf)."""
    by_epochs = math.isfinite(total) and (trainer.max_steps == -1 or total < trainer.max_steps)
    return replace(spelling, length="max_epochs" if by_epochs else "max_steps")


def precision_dtype(precision: str) -> str:
    """The dtype of ``Trainer(precision=...)``'s forward, as the other runs' ``dtype`` tag says it (the report's
    and the MLflow view's column); a setting not in :data:`PRECISION_DTYPES` as Lightning spells it. The run's
    tag until its first training forward shows the dtype it ran in (``ForwardDtype``: bf16 weights under
    ``32-true`` compute in bf16)."""
    return PRECISION_DTYPES.get(precision, precision)


def accumulation_schedule(trainer: pl.Trainer) -> GradientAccumulationScheduler | None:
    return next((c for c in trainer.callbacks if isinstance(c, GradientAccumulationScheduler)), None)


def planned_steps(trainer: pl.Trainer) -> float:
    """The optimizer steps the fit will take: ``max_steps`` and ``max_epochs`` both counted (the smaller); inf
    without a limit, ``max_steps`` (-1: none) when an IterableDataset's epoch has no length. Under a
    ``GradientAccumulationScheduler`` each epoch at its own factor: Lightning's ``estimated_stepping_batches``
    takes the one in force now (1 when the fit starts) for every epoch."""
    total = trainer.estimated_stepping_batches
    schedule, batches, epochs = accumulation_schedule(trainer), trainer.num_training_batches, trainer.max_epochs
    if schedule is None or epochs is None or epochs == -1 or not math.isfinite(batches):
        return total  # no schedule, or a length Lightning takes from max_steps alone
    steps = sum(math.ceil(batches / schedule.get_accumulate_grad_batches(e)) for e in range(max(epochs, 1)))
    return min(steps, trainer.max_steps) if trainer.max_steps != -1 else steps


class ClipampCallback(pl.Callback):
    """Record every optimizer step of a Lightning fit; calibrate τ as the runner does; clip at it if asked.

    Args:
        apply: clip at the calibrated τ once the window closes (else Lightning's clip is left alone).
        max_norm: the τ you clip at, when ``Trainer(gradient_clip_val=)`` does not say it (manual
            optimization, or ``apply=True``); ``None``: ``trainer.gradient_clip_val``. Refused under
            automatic optimization with ``apply=False`` (Lightning's clip is the one that runs) and
            beside a different ``gradient_clip_val``.
        csv_path: ``steps.csv`` without MLflow (default ``<default_root_dir>/clipamp/steps.csv``).
        tracking, experiment, run_name, skip_nonfinite, verbose, **calibrate: as ``StepRecorder``.
    """

    def __init__(
        self,
        *,
        apply: bool = False,
        max_norm: float | None = None,
        csv_path: str | Path | None = None,
        tracking: str | None = "auto",
        experiment: str | None = None,
        run_name: str | None = None,
        skip_nonfinite: bool | None = None,
        verbose: bool = True,
        **calibrate: Any,
    ) -> None:
        self.recorder = StepRecorder(
            apply=apply,
            calibrate=calibrate,
            csv_path=csv_path,
            tracking=tracking,
            experiment=experiment,
            run_name=run_name,
            skip_nonfinite=skip_nonfinite,
            verbose=verbose,
            spelling=LIGHTNING_SPELLING,
        )
        self.apply, self.max_norm = apply, max_norm
        self._user_clip: Any = None
        self._clip_taken = False  # apply=True sets trainer.gradient_clip_val to the policy's τ in this fit
        self._resume: dict[str, Any] | None = None  # the state load_state_dict got, for on_train_start
        self._recording = False  # on_train_start opened the record and on_fit_end has not closed it
        self._ended: tuple[int, dict[str, Any]] | None = None  # (step, state) where the last fit ended: fit() again
        self._measured = None
        self._clipped_by = None  # manual optimization: the τ a clip_gradients call in this step clipped at
        self._watch = None  # the wrapper _watch_clip put on the precision plugin
        self._dtype: ForwardDtype | None = None  # reads the dtype the fit's first training forward runs in

    @property
    def policy(self):
        return self.recorder.policy

    @property
    def summary(self):
        return self.recorder.summary

    # -- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The recorder's state at the last recorded step (``sweep.integrations.resume``), for the checkpoint."""
        return self.recorder.checkpoint_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A fit resumed from a checkpoint (``ckpt_path=``): the calibration and the records continue from
        ``state_dict`` when the training starts."""
        self._resume = state_dict

    # -- fit begin / end -----------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Refuse what the callback cannot record before anything is written; take the clip over (``apply``)."""
        if len(trainer.optimizers) > 1:
            raise ValueError(
                f"ClipampCallback records and calibrates the steps of one optimizer, and this fit has "
                f"{len(trainer.optimizers)}: each opt.step() would go into one calibration window, mixing the "
                "norms of different networks; configure one optimizer, or clip and record each network with "
                "the engine's own loop (docs/own-loop.md)"
            )
        algorithm = trainer.gradient_clip_algorithm  # Lightning's GradClipAlgorithmType (a str enum) or None
        if algorithm not in (None, "norm"):
            raise ValueError(
                f"gradient_clip_algorithm={getattr(algorithm, 'value', algorithm)!r}: ClipampCallback calibrates a "
                "norm threshold; use gradient_clip_algorithm='norm' or drop the callback"
            )
        if pl_module.automatic_optimization and self.max_norm is not None:
            if not self.apply:
                raise ValueError(
                    f"ClipampCallback(max_norm={self.max_norm}) with automatic optimization and apply=False: "
                    "Lightning clips at Trainer(gradient_clip_val=) and the callback leaves that clip alone; "
                    "pass the threshold as gradient_clip_val (max_norm is for manual optimization), or apply=True"
                )
            if trainer.gradient_clip_val is not None and trainer.gradient_clip_val != self.max_norm:
                raise ValueError(
                    f"ClipampCallback(max_norm={self.max_norm}) and Trainer(gradient_clip_val="
                    f"{trainer.gradient_clip_val}) name two thresholds: pass one"
                )
        self._user_clip = trainer.gradient_clip_val
        if self.apply:
            trainer.gradient_clip_val = None  # the policy's τ, set in on_before_optimizer_step
            self._clip_taken = True
        if not pl_module.automatic_optimization:  # a clip before opt.step() would leave only clipped norms to see
            self._watch_clip(trainer.precision_plugin)
        self.recorder.spelling = LIGHTNING_SPELLING if pl_module.automatic_optimization else MANUAL_SPELLING

    def _watch_clip(self, plugin) -> None:
        """Note each ``clip_gradients`` call of this fit's precision plugin (``self.clip_gradients`` in a manual
        ``training_step`` calls it) that clips: a τ > 0."""
        clip = plugin.clip_gradients

        def noted(optimizer, clip_val=0.0, *args, **kwargs):
            if clip_val and clip_val > 0:
                self._clipped_by = clip_val
            return clip(optimizer, clip_val, *args, **kwargs)

        plugin.clip_gradients, self._clipped_by = noted, None
        self._watch = noted

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open the record (after Lightning restored a checkpoint's callback states, whatever the strategy)."""
        tau = self.max_norm if self.max_norm is not None else self._user_clip
        schedule = accumulation_schedule(trainer)
        total = planned_steps(trainer)
        self.recorder.spelling = length_spelling(self.recorder.spelling, trainer, total)  # τ's: on_fit_start's
        resume, self._resume = self._resume, None
        if resume is not None and resume.get("step") == 0:  # saved before any step (the Tuner's lr_find restores one)
            resume = None
        ended, self._ended = self._ended, None
        if resume is None and trainer.global_step > 0:
            if trainer.ckpt_path:
                warn_fresh(trainer.global_step, "holds no ClipampCallback state (it was saved without the callback)")
            elif ended is not None and ended[0] == trainer.global_step:  # fit() again: on from where the last ended
                resume = ended[1]
            else:
                warn_fresh(trainer.global_step, "took steps this callback did not record", subject="the trainer")
        self.recorder.begin(
            resume=resume,
            total_steps=int(total) if math.isfinite(total) and total > 0 else None,
            user_tau=tau,
            default_csv=Path(trainer.default_root_dir) / "clipamp" / "steps.csv",
            main_process=trainer.is_global_zero,
            tags={
                "run": "lightning",
                "model": type(pl_module).__name__,
                "dtype": precision_dtype(str(trainer.precision)),
                "precision": str(trainer.precision),
            },
            params={
                **{f"calibrate.{k}": v for k, v in self.recorder.options.items() if k != "cap"},
                "apply": self.apply,
                "gradient_clip_val": tau,
                "accumulate_grad_batches": schedule.scheduling if schedule else trainer.accumulate_grad_batches,
            },
        )
        self._loss, self._losses, self._recording = None, 0, True
        compiled = getattr(pl_module, "_compiler_ctx", None) is not None  # hooks would split the compiled graph
        self._dtype = None if compiled else ForwardDtype(pl_module, trainer.strategy.root_device.type)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._give_clip_back(trainer)
        if self._recording:  # else the fit had no step to take (resumed at max_steps)
            self._recording = False
            self._ended = (trainer.global_step, self.recorder.checkpoint_state())  # before end() adopts a cut window
            self.recorder.end(trainer.global_step)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A fit an exception ends (Ctrl-C, an error): ``gradient_clip_val`` back as it was, the CSV closed, the
        MLflow run ended as KILLED (``KeyboardInterrupt``) or FAILED (anything else)."""
        self._give_clip_back(trainer)
        self._resume, self._recording = None, False
        self.recorder.abort(ended_as(type(exception)))

    def _give_clip_back(self, trainer: pl.Trainer) -> None:
        """``gradient_clip_val`` as the user set it; the precision plugin's own ``clip_gradients``; no dtype hook
        left on the module."""
        if self._dtype is not None:
            self._dtype.remove()
            self._dtype = None
        plugin = trainer.precision_plugin
        if self._watch is not None and plugin.__dict__.get("clip_gradients") is self._watch:
            del plugin.clip_gradients  # the watch of a manual fit: the plugin's own method again
        self._watch = None
        if self._clip_taken:
            trainer.gradient_clip_val = self._user_clip
            self._clip_taken = False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """Unscaled, accumulated, not yet clipped gradients: norm them in Lightning's clip order."""
        if self._measured is not None:  # manual: an earlier opt.step() of this batch; its loss is known at the end
            self._record(trainer, pl_module, batch_end=False)
        if self._clipped_by is not None:
            tau, self._clipped_by = self._clipped_by, None
            raise ValueError(
                f"the gradients were clipped at {tau} (self.clip_gradients) before opt.step(): ClipampCallback would "
                f"record the clipped norms as the pre-clip ones and calibrate on them; drop that call and pass its "
                f"τ to the callback, ClipampCallback(max_norm={tau}), which clips at it as that call does"
            )
        params = list(trainer.precision_plugin.main_params(optimizer))
        host_clips = pl_module.automatic_optimization  # Lightning clips after every on_before_optimizer_step hook
        if host_clips and self.apply:  # at the policy's τ: the module's own hook still sees the pre-clip gradients
            trainer.gradient_clip_val = self.recorder.clip_in_force()
        self._lr = float(optimizer.param_groups[0]["lr"])
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._scale = float(scaler.get_scale()) if scaler is not None else 1.0  # sync (fp16): this step's scale
        self._measured = self.recorder.measure(params, trainer.global_step + 1, host_clips=host_clips)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._loss = loss.detach().float() + (0 if self._loss is None else self._loss)
            self._losses += 1
        if self._measured is not None:  # else a micro-batch before the optimizer step
            self._record(trainer, pl_module, batch_end=True)

    def _record(self, trainer, pl_module, *, batch_end: bool) -> None:
        """The step measured last, done: its record (``batch_end``: with the loss of the batches since the last)."""
        m, self._measured = self._measured, None
        no_loss = False
        if batch_end:
            if self._loss is not None:
                # the mean of the batches since the last step: Lightning divides each loss by accumulate_grad_batches
                # (automatic optimization; 1 under manual), also on a step the epoch's end cuts short
                m.loss = float(self._loss * (trainer.accumulate_grad_batches / self._losses))  # sync: once per step
            no_loss = pl_module.automatic_optimization and not self._losses  # training_step returned None throughout
            self._loss, self._losses = None, 0
        if no_loss:  # no backward, no gradient: Lightning counts the step, the optimizer changes nothing
            m.pre = m.post = m.policy_post = math.nan
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        # fp16: the GradScaler skipped optimizer.step() (an inf/NaN gradient) iff its update backed the scale off
        skipped = no_loss or (scaler is not None and float(scaler.get_scale()) < self._scale)  # sync (fp16)
        why = "no_loss" if no_loss else ""
        self.recorder.record(trainer.global_step, self._lr, m, scale=self._scale, skipped=skipped, why=why)
        if self._dtype is not None and self._dtype.tag(self.recorder.tracker):  # e.g. bf16 weights under 32-true
            self._dtype = None
