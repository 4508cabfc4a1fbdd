"""``ClipampCallback``: clipamp's per-step record and norm calibration inside an unmodified ``Trainer.train()``.

    from transformers import Trainer
    from sweep.integrations.hf_trainer import ClipampCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[ClipampCallback(window=100)])
    trainer.train()  # steps.csv + an MLflow run; the recommended max_grad_norm after step 100

One optimizer step of ``Trainer`` (transformers 5) and where the callback acts::

    backward × micro-batches → Trainer: unscale (fp16) + ‖g‖ [+ clip] → on_pre_optimizer_step
    → optimizer.step (fp16: GradScaler may skip) → on_optimizer_step → scheduler → zero_grad → on_step_end

- Clipping happens in Trainer between the last backward and ``on_pre_optimizer_step``, where no
  callback runs, and Trainer keeps the pre-clip norm to itself except in its logs. So the
  callback takes the clip over: at train begin it sets ``args.max_grad_norm = 0`` (Trainer then
  only measures ‖g‖ and logs it as ``grad_norm``) and in ``on_pre_optimizer_step`` clips the same
  gradients with the same rule, ``g · min(1, τ / (‖g‖ + 1e-6))``, at your ``max_grad_norm`` — or,
  with ``apply=True``, at the calibrated τ once the window closes. The window, its summary and
  the τ in force are the engine's ``CalibratedClip`` (the policy of ``clip=calibrated`` runs; with
  ``apply=True`` it clips too, at your ``max_grad_norm`` as its cap until the window closes).
  ``args`` is restored at train end. ``grad_l2_pre_clip`` is therefore Trainer's own
  ``grad_norm``; ``grad_l2_post_clip`` the norm the optimizer received.
- Loss: the model's own ``outputs.loss`` (a forward hook), combined as Trainer combines it:
  summed over micro-batches when Trainer passes ``num_items_in_batch`` (then it is the token
  mean over the accumulated batch), else averaged. With a ``compute_loss_func`` or label
  smoothing the loss is computed outside the model and the column stays empty.
  ``token_count``: labels ≠ -100 after the causal shift.
- Skips: under fp16 (CUDA) the GradScaler skips overflow steps (read from the optimizer) and
  ``scaler_scale`` is its scale (1.0 without a scaler). Under bf16/fp32 Trainer would apply a
  non-finite gradient; ``skip_nonfinite=True`` drops the gradients so ``optimizer.step()``
  changes nothing (the LR schedule still advances, as with Trainer's fp16 skips).
- Not seen: the data source of a batch, per-micro-batch norms. Refused: DeepSpeed and FSDP
  (they clip inside their engines). Under DDP the gradients are all-reduced before the clip:
  every rank clips alike, rank 0 records (its local loss).

Records and MLflow use the names of ``python -m sweep`` runs (the canonical ``steps.csv``,
``grad_norm_p50…p99``, ``recommended_max_norm``, ``clip_ratio``, ``skip_ratio``, ``final_loss``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import TrainerCallback

from clipamp_engine import (
    CalibratedClip,
    NormCalibrator,
    SkipLog,
    StepCSVWriter,
    StepLog,
    clip_global_l2_norm,
    total_norm,
)
from clipamp_engine.calibration import CalibrationError
from clipamp_engine.norms import grads_of

from ..run.loop import RunRecords
from ..run.summary import summary_metrics

COLUMNS = ("clipped", "token_count", "max_norm", "phase", "grad_l2_token_normalised")


class ClipampCallback(TrainerCallback):
    """Record every optimizer step of ``Trainer``; calibrate τ on the first ``window`` steps.

    Args:
        window: steps 1..window form the calibration window (≥ 2).
        quantile: τ = Quantile_q of the window's finite pre-clip norms.
        apply: clip at the calibrated τ from step window+1 on (else keep ``args.max_grad_norm``).
        csv_path: where ``steps.csv`` goes without MLflow (default ``<output_dir>/clipamp/steps.csv``).
        tracking: ``"auto"``: an MLflow run (a child of the active run, if any) in
            ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlruns/mlflow.db``; a tracking URI; ``None``: CSV only.
        experiment, run_name: the MLflow experiment and run name.
        skip_nonfinite: bf16/fp32: refuse an update whose gradient norm is inf/NaN.
        candidates: fixed thresholds whose would-be clipping ratio the window reports.
        verbose: print the CSV path and the recommendation.
    """

    def __init__(
        self,
        *,
        window: int = 100,
        quantile: float = 0.95,
        apply: bool = False,
        csv_path: str | Path | None = None,
        tracking: str | None = "auto",
        experiment: str = "clipamp",
        run_name: str | None = None,
        skip_nonfinite: bool = True,
        candidates: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0),
        verbose: bool = True,
    ) -> None:
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window={window!r} must be an integer >= 2 (steps in the calibration window)")
        self.policy = CalibratedClip(window, quantile=quantile, candidates=candidates)  # validates quantile
        self.window, self.quantile, self.candidates, self.apply = window, quantile, tuple(candidates), apply
        self.csv_path, self.tracking, self.experiment, self.run_name = csv_path, tracking, experiment, run_name
        self.skip_nonfinite, self.verbose = skip_nonfinite, verbose
        self.records = RunRecords()
        self.summary = None  # CalibrationSummary once the window closes
        self.tau: float | None = None
        self.tracker = self.writer = self._hook = self._args = None
        self._user_tau = 0.0

    # -- train begin / end ---------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if args.deepspeed or args.fsdp:
            raise ValueError(
                "ClipampCallback does not support DeepSpeed or FSDP (they clip inside their engines); "
                "run without them, or drop the callback"
            )
        self._args, self._user_tau = args, args.max_grad_norm
        self.tau = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        args.max_grad_norm = 0.0  # Trainer measures ‖g‖ without clipping; we clip in on_pre_optimizer_step
        # steps 1..window (cut at the run's end, if shorter); until it closes, clip at the user's τ (apply=True)
        self.policy = CalibratedClip(
            self.window,
            quantile=self.quantile,
            candidates=self.candidates,
            cap=self.tau,
            total_steps=state.max_steps if state.max_steps > 0 else None,
        )
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        self._reset()
        if state.is_world_process_zero:
            self._open(args, model)

    def _open(self, args, model) -> None:
        path = Path(self.csv_path) if self.csv_path else Path(args.output_dir) / "clipamp" / "steps.csv"
        if self.tracking is not None:
            self.tracker = _open_run(
                self.tracking, self.experiment, self.run_name or f"trainer-{type(model).__name__}", args, model, self
            )
            path = self.tracker.artifact_path("steps.csv")
        self.writer = StepCSVWriter(path, COLUMNS)
        self.say(f"steps.csv: {path}")

    def on_train_end(self, args, state, control, **kwargs):
        args.max_grad_norm = self._user_tau
        if self._hook is not None:
            self._hook.remove()
        open_window = self.policy.state_dict()["calibrator"]  # the run stopped inside its window (early stop)
        if self.summary is None and open_window is not None:
            seen = NormCalibrator(self.quantile, self.candidates)
            seen.load_state_dict(open_window)
            if len(seen.norms) >= 2:
                self._close_window(seen.summary)  # summarise what it saw
        if self.writer is None:
            return
        self.writer.close()
        windows = [self.summary] if self.summary else []
        # the app's summary (it reads cfg.calibrate.quantile only when there is no window)
        metrics = summary_metrics(
            SimpleNamespace(calibrate=SimpleNamespace(quantile=self.quantile)), self.records, windows
        )
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=state.global_step)
            self.tracker.artifact_path("quantiles.json").write_text(
                json.dumps({"metrics": metrics, "windows": [w.as_dict() for w in windows]}, indent=2, default=float)
            )
            self.tracker.end("FINISHED")
        if windows:
            self.say(
                f"clipping ratio after the window at τ={f'{self.tau:.4g}' if self.tau else 'none'}: "
                f"{metrics['clip_ratio']:.1%}; skipped steps {metrics['skip_ratio']:.1%}"
            )

    # -- one optimizer step --------------------------------------------------------------------
    def _reset(self) -> None:
        self._loss = self._tokens = None
        self._micro, self._loss_is_sum, self._dropped = 0, False, False

    def on_step_begin(self, args, state, control, **kwargs):
        self._reset()

    def _on_forward(self, module, args, kwargs, output) -> None:
        if not module.training:
            return  # evaluation forwards
        self._micro += 1
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is not None:
            self._loss = loss.detach().float() + (0 if self._loss is None else self._loss)
        self._loss_is_sum = "num_items_in_batch" in kwargs
        labels = kwargs.get("labels")
        if labels is not None:
            n = (labels[..., 1:] != -100).sum()
            self._tokens = n if self._tokens is None else self._tokens + n

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        """Unscaled, accumulated, not yet clipped gradients: measure, clip at τ, read everything back once."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        scaler = getattr(optimizer, "scaler", None)
        self._has_scaler = scaler is not None and scaler.is_enabled()
        self._scale = float(scaler.get_scale()) if self._has_scaler else 1.0  # sync (CUDA fp16): this step's scale
        self._lr = float(optimizer.param_groups[0]["lr"])
        if self.apply:  # the policy's τ: the cap (user's max_grad_norm) in the window, the calibrated τ after
            grads = grads_of(params)
            pre = total_norm(grads)
            finite = torch.isfinite(pre)  # a non-finite gradient is left as it is (like clip_global_l2_norm)
            post = torch.where(
                finite, self.policy.clip_(params, grads, torch.where(finite, pre, 0.0), state.global_step + 1), pre
            )
            self.tau = self.policy.threshold
        elif self.tau is None:
            pre = post = total_norm(grads_of(params))
        else:
            pre, post = clip_global_l2_norm(params, self.tau)
        nan = torch.tensor(float("nan"), device=pre.device)
        loss = nan if self._loss is None else self._loss / (1 if self._loss_is_sum else max(self._micro, 1))
        tokens = nan if self._tokens is None else self._tokens.float()
        self._pre, self._post, self._step_loss, tok = torch.stack(
            [pre, post, loss.to(pre.device), tokens.to(pre.device)]
        ).tolist()  # sync: the record
        self._step_tokens = None if math.isnan(tok) else int(tok)
        if not math.isfinite(self._pre) and self.skip_nonfinite and not self._has_scaler:
            for p in params:  # optimizer.step() skips parameters without a gradient
                p.grad = None
            self._dropped = True

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self._skipped = self._dropped or bool(getattr(optimizer, "step_was_skipped", False))

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        tok = self._step_tokens
        common = dict(
            step=step,
            lr=self._lr,
            grad_l2_pre_clip=self._pre,
            loss=self._step_loss,
            scaler_scale=self._scale,
            token_count=tok,
            max_norm=self.tau,
            extra={
                "phase": self.policy.phase(step),
                "grad_l2_token_normalised": self._pre * math.sqrt(tok) if tok else None,
            },
        )
        if self._skipped:
            log = SkipLog(grad_l2_post_clip=float("nan"), clipped=False, skip_reason="nonfinite_grad", **common)
        else:
            log = StepLog(grad_l2_post_clip=self._post, clipped=self._post < self._pre, **common)
        try:
            self.policy.observe(log)  # at the window's last step: its summary, τ adopted for the next step
        except CalibrationError as e:  # every step of the window was skipped
            self.say(f"{e}: no recommendation")
        if self.policy.summaries and self.summary is None:
            self._close_window(lambda: self.policy.summaries[-1])
        if self.writer is not None:
            row = log.row()
            self.writer.write(row)
            self.records.rows.append(row)
            if self.tracker is not None:
                self.tracker.add_step(step, self.records.step_metrics())

    def _close_window(self, summary) -> None:
        try:
            self.summary = s = summary()
        except ValueError as e:  # every step of the window was skipped
            self.say(f"{e}: no recommendation")
            return
        tau = s.recommended_max_norm
        q = s.quantiles
        self.say(
            f"calibration window steps {s.start_step}–{s.end_step} ({s.n_finite} finite, {s.n_skipped} skipped): "
            f"‖g‖ p50 {q['p50']:.4g}  p95 {q['p95']:.4g}  p99 {q['p99']:.4g}  max {q['max']:.4g} → "
            f"recommended max_grad_norm={tau:.4g} (Quantile_{self.quantile:g}); "
            + (
                f"applied from step {s.end_step + 1}"
                if self.apply
                else f"not applied (ClipampCallback(apply=True) clips at it; max_grad_norm stays {self._user_tau:g})"
            )
        )
        if self.tracker is not None:
            self.tracker.log_metrics(
                {**{f"window_{k}": v for k, v in q.items()}, "window_recommended_max_norm": tau}, step=s.end_step
            )

    def say(self, message: str) -> None:
        if self.verbose and self.writer is not None:
            print(f"clipamp: {message}", flush=True)


def _open_run(tracking: str, experiment: str, run_name: str, args, model, cb: ClipampCallback):
    """A RunTracker for the callback's MLflow run (a child of the process's active run, if any)."""
    import mlflow

    from ..tracking.tracker import RunTracker, Store

    active = mlflow.active_run() if tracking == "auto" else None
    store = Store.open(mlflow.get_tracking_uri() if active else None if tracking == "auto" else tracking, experiment)
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    tags = {"run": "trainer", "dtype": dtype, "model": type(model).__name__, "device": args.device.type}
    tracker = RunTracker(
        store.client, store.experiment_id, run_name, tags=tags, parent_run_id=active.info.run_id if active else None
    )
    tracker.log_params(
        {
            "calibrate.window": cb.window,
            "calibrate.quantile": cb.quantile,
            "apply": cb.apply,
            "max_grad_norm": cb._user_tau,
            "learning_rate": args.learning_rate,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
        }
    )
    return tracker
