"""The core every framework integration drives, one optimizer step at a time: measure, clip, record, calibrate.

A host framework (``transformers.Trainer``, Lightning, accelerate, a hand loop) calls ``begin(total_steps=…,
user_tau=…, default_csv=…)`` once, then per optimizer step ``measure(params, step, host_clips=…)`` on the
unscaled, accumulated, not yet clipped gradients — ``params`` in the order the host itself norms them —
and, once the step is done, ``record(step, lr, measured)``; ``end(step)`` at the end. In between the
host's optimizer runs. The calibration is the engine's ``CalibratedClip`` with the runner's options
(``clipamp_engine.clip.calibrated.RECOMMENDED``: window after the warm-up and the norms' transient,
τ aimed at the band's middle with its interval, held-out validation with a verdict and next action,
drift), so the numbers equal a ``+experiment=calibrate`` run's on the same norms.

- ``apply=False`` (default) changes nothing in the host's run: the norm is
  ``torch.nn.utils.get_total_norm`` over the host's parameters in the host's order, and a clip at the
  host's own τ, where this object does it for the host, is ``torch.nn.utils.clip_grad_norm_`` itself.
  The calibrated τ is only recommended; its checks count the steps it *would* have clipped.
- ``apply=True`` clips at the policy's τ with the same norm and clip (bf16/fp16 gradients normed in their
  dtype, as torch does): the host's τ as the cap until the first window closes (or nothing, without one),
  the calibrated τ after it; non-finite gradients are dropped (``skip_nonfinite``).

A run its host never ends (an exception out of ``Trainer.train()`` or a hand loop, ``end()`` never
called) is closed when the process exits (``atexit``): the ``steps.csv`` with every step recorded,
the buffered per-step metrics sent, and the MLflow run ended as FAILED (an error), or KILLED
(Ctrl-C, or an exit without one), rather than left RUNNING.

Beside the ``steps.csv`` it writes ``steps.clipamp.yaml`` (``sweep.run.csv_settings``): the calibration
options and the run's length, so that ``python -m sweep.recommend steps.csv`` replays this calibration.

A host that saves checkpoints keeps ``checkpoint_state()`` in each and, resuming from one, hands it back
as ``begin(resume=…)``: the calibration, the ``steps.csv`` and the MLflow run go on from it
(``sweep.integrations.resume``).

The records, the ``steps.csv`` columns and the MLflow metric names are those of ``python -m sweep`` runs (the
run's tags are the integration's own: ``run``, and the model, dtype or precision it knows)."""

from __future__ import annotations

import atexit
import math
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from clipamp_engine.calibration import CalibrationError
from clipamp_engine.clip.calibrated import RECOMMENDED, CalibratedClip
from clipamp_engine.csvlog import StepCSVWriter
from clipamp_engine.norms import clip_coefficient, grads_of
from clipamp_engine.records import SkipLog, StepLog
from clipamp_engine.spelling import ENGINE, Spelling

from ..errors import one_line
from ..run.artifacts import json_text
from ..run.calibration import calibration_payload
from ..run.csv_settings import length_tags, write_settings
from ..run.loop import RunRecords
from ..run.summary import summary_metrics
from .resume import checkpoint_state, new_run, open_store
from .resume import resume as restore
from .window_lines import check_lines, interval, no_window, placement_line

#: The recorders of this process with a run open: a resume that continues another's run takes it over.
_OPEN: weakref.WeakSet = weakref.WeakSet()

COLUMNS = ("clipped", "token_count", "max_norm", "phase", "grad_l2_token_normalised")


@dataclass
class Measured:
    """One step's norms as host floats (read back once): pre-clip, post-clip, would-be post-clip at the policy's τ."""

    pre: float
    post: float
    policy_post: float
    loss: float
    tokens: int | None
    dropped: bool  # a non-finite gradient was dropped (apply / skip_nonfinite): the update changed nothing


class StepRecorder:
    """Record → calibrate → (optionally) apply, for one run of a host framework.

    Args:
        apply: clip at the calibrated τ (else only recommend it; the host's run is unchanged).
        calibrate: overrides of ``RECOMMENDED`` (``window``, ``quantile``, ``start``, ``every``,
            ``validate``, ``candidates``, ``target_clip``, ``confidence``).
        csv_path: ``steps.csv`` when there is no MLflow run.
        tracking: ``"auto"`` (``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlruns/mlflow.db``, a child of the
            active run if any), a tracking URI, or ``None`` (CSV only).
        experiment: the MLflow experiment (``None``: the active run's when nested under one, else ``clipamp``).
        run_name: the MLflow run name.
        skip_nonfinite: drop a non-finite gradient so that the optimizer step changes nothing
            (default: ``apply``; off, the host's run is left as it is).
        verbose: print the CSV path, each window's recommendation and the verdicts.
        spelling: how the advice names the settings: the host's (its τ and length, the integration's keywords).
    """

    def __init__(
        self,
        *,
        apply: bool = False,
        calibrate: dict[str, Any] | None = None,
        csv_path: str | Path | None = None,
        tracking: str | None = "auto",
        experiment: str | None = None,
        run_name: str | None = None,
        skip_nonfinite: bool | None = None,
        verbose: bool = True,
        spelling: Spelling = ENGINE,
    ) -> None:
        self.spelling = spelling
        if "cap" in (calibrate or {}):
            raise ValueError(
                "cap: the τ until the first window closes is the host's own (max_grad_norm, gradient_clip_val, "
                "max_norm), clipped at with apply=True; drop cap="
            )
        self.options = {**RECOMMENDED, **(calibrate or {})}
        accepted = [k for k in RECOMMENDED if k != "cap"]
        unknown = sorted(set(self.options) - set(RECOMMENDED))
        if unknown:
            raise ValueError(f"calibration options {', '.join(unknown)} are not among {', '.join(accepted)}")
        self.policy = CalibratedClip(**self.options, spelling=spelling)  # validates the options now
        self.apply, self.csv_path, self.tracking = bool(apply), csv_path, tracking
        self.experiment, self.run_name, self.verbose = experiment, run_name, verbose
        self.skip_nonfinite = self.apply if skip_nonfinite is None else bool(skip_nonfinite)
        self.records = RunRecords()
        self.tracker = self.writer = None
        self.store_label: str | None = None  # the MLflow store's URI as a checkpoint names it
        self.user_tau: float | None = None
        self.step = 0  # the last step recorded
        self.lengths: list[list] = []  # [[after_step, total_steps], …]: the run's length as the calibration knew it
        self._announced = 0
        self.columns = COLUMNS

    def calibration_options(self) -> dict[str, Any]:
        """The calibration options (``RECOMMENDED`` with the overrides), the cap aside: it is the host's τ."""
        return {k: v for k, v in self.options.items() if k != "cap"}

    def checkpoint_state(self) -> dict[str, Any]:
        """What a host's checkpoint keeps of this recorder, as JSON (``sweep.integrations.resume``). From then on
        the MLflow run takes no step after this one until the next checkpoint or the run's end: a resume from
        this checkpoint trains those steps again (``RunTracker.hold_after``)."""
        if self.tracker is not None:
            self.tracker.hold_after(self.step)
        return checkpoint_state(self)

    # -- run begin / end -------------------------------------------------------------------------
    def begin(
        self,
        *,
        total_steps: int | None,
        user_tau: float | None,
        default_csv: Path,
        main_process: bool = True,
        tags: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        resume: dict[str, Any] | None = None,
    ) -> None:
        """Build the policy for a run of ``total_steps`` and open its CSV (and MLflow run) on the main process.
        A run an exception cut short (``end`` never called) is closed first: its CSV, and its MLflow run as
        KILLED. ``resume``: the ``checkpoint_state`` saved with the host's checkpoint the run resumes from;
        the policy continues from it, and the records continue those of the checkpoint's run
        (``sweep.integrations.resume``)."""
        self.abort("KILLED")
        atexit.register(self._at_exit)
        self.set_user_tau(user_tau)
        cap = self.user_tau if self.apply else None  # apply: the host's τ until the first window closes
        self.policy = CalibratedClip(**{**self.options, "cap": cap}, total_steps=total_steps, spelling=self.spelling)
        self.records, self._announced, self.step = RunRecords(), 0, 0
        self.lengths = [[0, total_steps]]  # a resume continues the checkpoint's
        tags, params = tags or {}, {**(params or {}), "total_steps": total_steps}  # as the calibration knows it
        name = self.run_name or f"{tags.get('run', 'host')}-{tags.get('model', 'model')}"
        path = Path(self.csv_path) if self.csv_path else default_csv
        _OPEN.add(self)
        if resume is not None:
            restore(self, resume, path=path, main_process=main_process, run_name=name, tags=tags, params=params)
            self._take_over()
            if self.tracker is not None and len(self.lengths) > 1:  # its param total_steps is the first length
                self.tracker.set_tags(length_tags(self.lengths))
        elif main_process:
            if self.tracking is not None:
                store, parent, self.store_label = open_store(self.tracking, self.experiment)
                self.tracker = new_run(store, parent, name, tags, params)
                path = self.tracker.artifact_path("steps.csv")
            self.writer = StepCSVWriter(path, COLUMNS)
            self.say(f"steps.csv: {path}")
        if self.writer is not None:  # beside the CSV: what `python -m sweep.recommend steps.csv` replays
            write_settings(
                self.writer.path,
                run=tags.get("run", "host"),
                options=self.calibration_options(),
                lengths=self.lengths,
                apply=self.apply,
            )

    def _take_over(self) -> None:
        """This resumed recorder continues the run (or CSV) of another of this process that an exception left
        open (a notebook resuming after a crash): that one lets go without ending or flushing it, so that its
        exit handler neither ends the continued run nor sends the steps the resume dropped."""
        mine = (self.tracker.run_id if self.tracker else None, self.writer.path if self.writer else None)
        for other in list(_OPEN):
            theirs = (other.tracker.run_id if other.tracker else None, other.writer.path if other.writer else None)
            if other is not self and any(a is not None and a == b for a, b in zip(mine, theirs)):
                atexit.unregister(other._at_exit)
                if other.writer is not None:
                    other.writer.close()
                other.writer = other.tracker = None
                _OPEN.discard(other)

    def abort(self, status: str) -> None:
        """Close the CSV and end the MLflow run (if still open) with ``status``: FAILED or KILLED."""
        atexit.unregister(self._at_exit)
        _OPEN.discard(self)
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.tracker is not None and not self.tracker.ended:
            self.tracker.end(status)
        self.tracker = None

    def _at_exit(self) -> None:
        """The process exits with the run open: FAILED after an uncaught error, else KILLED."""
        crash = getattr(sys, "last_type", None)  # set by the interpreter for the exception that ends it
        status = "FAILED" if crash is not None and not issubclass(crash, KeyboardInterrupt) else "KILLED"
        tracker = self.tracker
        try:
            self.abort(status)
        except Exception as e:  # the store is gone: one line, the CSV is closed already
            print(f"clipamp: the run could not be ended as {status}: {one_line(e, 200)}", file=sys.stderr)
            return
        if tracker is not None:
            print(f"clipamp: MLflow run {tracker.run_id} ended as {status} at step {self.step}", file=sys.stderr)

    def end(self, step: int) -> dict[str, float]:
        """Close the CSV and the MLflow run; a first window an early stop cut is summarised as it stands (a later one
        is dropped), a stop before ``total_steps`` is said. Cut short (Ctrl-C), it leaves the run to the atexit hook."""
        if not self.policy.summaries:
            try:
                closed = self.policy.close_early()
            except CalibrationError as e:  # the window's norms are zero
                self.say(f"{e}: no recommendation")
            else:
                if closed:
                    self._announce()
                else:
                    self.say(f"no calibration window by step {step}: {no_window(self.policy)}: no recommendation")
        if self.writer is None:  # a process that records nothing
            self.abort("FINISHED")
            return {}
        self.writer.close()
        windows = list(self.policy.summaries)
        cfg = SimpleNamespace(calibrate=SimpleNamespace(quantile=self.policy.quantile))
        metrics = summary_metrics(cfg, self.records, windows)
        stopped = self.policy.stopped_early(step) if self.policy.summaries else None  # else: the no-window line
        for line in [*check_lines(self.policy), *([stopped] if stopped else [])]:
            self.say(line)
        if self.tracker is not None:
            self.tracker.log_metrics(metrics, step=step)
            if stopped:  # the MLflow view's column: a run whose check the stop cut
                self.tracker.set_tags({"stopped_early": stopped})
            payload = {"metrics": metrics, **calibration_payload(self.policy), "stopped_early": stopped}
            self.tracker.artifact_path("quantiles.json").write_text(json_text(payload))
            self.tracker.end("FINISHED")
        atexit.unregister(self._at_exit)  # ended: nothing left for the exit handler
        _OPEN.discard(self)
        return metrics

    # -- one optimizer step ----------------------------------------------------------------------
    @property
    def tau(self) -> float | None:
        """The calibrated τ, once a window closed (recommended; applied with ``apply=True``)."""
        return self.policy.tau

    @property
    def summary(self):
        """The first window's ``CalibrationSummary`` (``None`` until it closes)."""
        return self.policy.summaries[0] if self.policy.summaries else None

    def set_user_tau(self, tau: float | None) -> None:
        """The host's τ from now on (a host whose clip threshold changes between steps; ``apply=False``)."""
        self.user_tau = tau if tau and tau > 0 else None

    def clip_in_force(self) -> float | None:
        """The τ the gradients of the next step are clipped at (``None``: not clipped)."""
        return self.policy.threshold if self.apply else self.user_tau

    def measure(
        self,
        params: list[torch.Tensor],
        step: int,
        *,
        host_clips: bool,
        after_host_pass: bool = False,
        loss: Any = None,
        tokens: Any = None,
    ) -> Measured:
        """Norm (and clip, unless ``host_clips``) the unscaled, accumulated gradients of ``params`` for ``step``.

        ``host_clips``: the host clips after this call at its own τ (measure only: ``apply=False``, or a host
        given ``clip_in_force()`` as its τ for the step).
        ``after_host_pass``: the host has already run its clip at a τ too large to clip a finite norm
        (``Trainer`` with ``NORM_ONLY_MAX_NORM``): that left a finite-norm gradient as it was and gave
        a non-finite one the coefficient every τ gives it (0 for an inf norm: finite elements 0, infs
        NaN). So the host's own clip, done here, multiplies finite-norm gradients only.
        ``loss``/``tokens``: the step's loss and token count as device tensors, read back with the norms.
        """
        grads = grads_of(params)
        tau = self.clip_in_force()
        if self.apply and not host_clips:  # the host's clip (torch's), at the policy's τ; a non-finite norm: untouched
            pre = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            finite = torch.isfinite(pre)
            if tau is not None:
                torch.nn.utils.clip_grads_with_norm_(params, tau, torch.where(finite, pre, 0.0))
            post = pre if tau is None else torch.where(finite, pre * clip_coefficient(pre, tau), pre)
        elif tau is None or host_clips:
            pre = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            post = pre if tau is None else pre * clip_coefficient(pre, tau)
        elif after_host_pass:  # torch's clip_grad_norm_ in its two halves, the second for a finite norm only
            pre = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            torch.nn.utils.clip_grads_with_norm_(params, tau, torch.where(torch.isfinite(pre), pre, 0.0))
            post = pre * clip_coefficient(pre, tau)
        else:  # the host's own clip, done for it: torch's, exactly
            pre = torch.nn.utils.clip_grad_norm_(params, tau)
            post = pre * clip_coefficient(pre, tau)
        policy_tau = self.policy.threshold  # the calibrated τ once adopted: what the checks count
        policy_post = post if self.apply or policy_tau is None else pre * clip_coefficient(pre, policy_tau)
        nan = torch.full((), math.nan, device=pre.device)
        extra = [nan if v is None else torch.as_tensor(v).detach().float().to(pre.device) for v in (loss, tokens)]
        values = torch.stack([pre.float(), post.float(), policy_post.float(), *extra]).tolist()  # sync: the record
        dropped = False
        if not math.isfinite(values[0]) and self.skip_nonfinite:
            for p in params:  # optimizer.step() skips parameters without a gradient
                p.grad = None
            dropped = True
        tok = None if math.isnan(values[4]) else int(values[4])
        return Measured(values[0], values[1], values[2], values[3], tok, dropped)

    def record(
        self, step: int, lr: float, m: Measured, *, scale: float = 1.0, skipped: bool = False, why: str = ""
    ) -> StepLog:
        """The step's record: fed to the calibration, written to ``steps.csv`` and MLflow. ``skipped``: the host
        did not update (``why``: the ``SKIP_REASONS`` entry, ``nonfinite_grad`` unless said)."""
        tok = m.tokens
        common = dict(
            step=step,
            lr=lr,
            grad_l2_pre_clip=m.pre,
            loss=m.loss,
            scaler_scale=scale,
            token_count=tok,
            max_norm=self.clip_in_force(),
            extra={
                "phase": self.policy.phase(step),
                "grad_l2_token_normalised": m.pre * math.sqrt(tok) if tok else None,
            },
        )
        if skipped or m.dropped:
            log = SkipLog(grad_l2_post_clip=math.nan, clipped=False, skip_reason=why or "nonfinite_grad", **common)
            seen = log
        else:
            log = StepLog(grad_l2_post_clip=m.post, clipped=m.post < m.pre, **common)
            seen = StepLog(**{**common, "grad_l2_post_clip": m.policy_post, "clipped": m.policy_post < m.pre})
        try:
            self.policy.observe(seen)  # at a window's last step: its summary; τ adopted for the next step
        except CalibrationError as e:  # every step of the window was skipped
            self.say(f"{e}: no recommendation")
        self.step = step
        self._announce()
        if self.writer is not None:
            row = log.row()
            self.writer.write(row)
            self.records.rows.append(row)
            if self.tracker is not None:
                self.tracker.add_step(step, self.records.step_metrics())
        return log

    def _announce(self) -> None:
        """One line per newly closed window: where it was, its quantiles and the recommended τ."""
        if not self._announced and self.policy.summaries:  # the first window: where it lies and why
            self.say(placement_line(self.policy))
        for s in self.policy.summaries[self._announced :]:
            q, ci = s.quantiles, s.tau_ci
            self.say(
                f"calibration window steps {s.start_step}–{s.end_step} ({s.n_finite} finite, {s.n_skipped} skipped): "
                f"‖g‖ p50 {q['p50']:.4g}  p95 {q['p95']:.4g}  p99 {q['p99']:.4g} → recommended τ="
                f"{s.recommended_max_norm:.4g} (Quantile_{self.policy.quantile:.3g}, {interval(ci)}) "
                f"predicting {s.predicted_clip_ratio:.1%} clipped; "
                + (f"applied from step {s.end_step + 1}" if self.apply else "not applied (apply=True clips at it)")
            )
            if self.tracker is not None:
                window = {f"window_{k}": v for k, v in q.items()}
                self.tracker.log_metrics({**window, "window_recommended_max_norm": s.recommended_max_norm}, s.end_step)
        self._announced = len(self.policy.summaries)

    def say(self, message: str) -> None:
        if self.verbose and self.writer is not None:
            print(f"clipamp: {message}", flush=True)
