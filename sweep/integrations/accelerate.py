"""``ClipampAccelerate``: clipamp's per-step record and norm calibration in a Hugging Face ``accelerate`` loop.

accelerate has no callbacks: the loop is yours, and its clip is one call. Replace that call::

    clipamp = ClipampAccelerate(accelerator, total_steps=N)     # the runner's calibration
    for batch in loader:
        with accelerator.accumulate(model):
            loss = loss_fn(model(batch["x"]), batch["y"])
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                clipamp.clip_grad_norm_(model.parameters(), max_norm)   # was accelerator.clip_grad_norm_
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                clipamp.step_end(loss)
    clipamp.end()

``clip_grad_norm_`` unscales the gradients (``accelerator.unscale_gradients()``, a no-op without
fp16) and, with ``apply=False`` (default), calls ``torch.nn.utils.clip_grad_norm_`` on the same
parameters, which is what ``accelerator.clip_grad_norm_`` does in one process: the run is
bit-identical (``docs/accelerate.md``), each call at the ``max_norm`` it is given. With
``apply=True`` it clips at the policy's τ (the first call's ``max_norm`` until the window closes,
the calibrated τ after). It returns the pre-clip norm, as accelerate's does (a CPU tensor).
DeepSpeed, FSDP and XLA clip inside their engines and are refused.

Checkpoints: ``accelerator.register_for_checkpointing(clipamp)`` puts its state (the recorder's
``checkpoint_state``) in every ``accelerator.save_state``; after ``accelerator.load_state`` the next
``clip_grad_norm_`` continues the calibration, the ``steps.csv`` and the MLflow run from it
(``sweep.integrations.resume``). A ``load_state`` that does not restore it (not registered) is said
in one ``ResumeWarning`` line: the calibration and the records then start afresh.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from clipamp_engine.spelling import Spelling

from .recorder import Measured, StepRecorder
from .resume import ResumeWarning

REFUSED = ("DEEPSPEED", "FSDP", "XLA")
#: The advice's settings as an accelerate loop writes them: ``clipamp.clip_grad_norm_(params, max_norm=)``,
#: ``ClipampAccelerate(total_steps=, start=…, window=…)``.
ACCELERATE_SPELLING = Spelling(threshold="max_norm", length="total_steps")


class ClipampAccelerate:
    """The clip call of an accelerate loop, recorded and calibrated as the runner does.

    Args:
        accelerator: the loop's ``accelerate.Accelerator``.
        total_steps: optimizer steps in the run (the window's placement needs it; ``None``: unknown).
        apply: clip at the calibrated τ once the window closes (else at your ``max_norm``, unchanged).
        csv_path: ``steps.csv`` without MLflow (default ``<cwd>/clipamp/steps.csv``).
        tracking, experiment, run_name, skip_nonfinite, verbose, **calibrate: as ``StepRecorder``.
    """

    def __init__(
        self,
        accelerator: Any,
        *,
        total_steps: int | None = None,
        apply: bool = False,
        csv_path: str | Path | None = None,
        tracking: str | None = "auto",
        experiment: str | None = None,
        run_name: str | None = None,
        skip_nonfinite: bool | None = None,
        verbose: bool = True,
        **calibrate: Any,
    ) -> None:
        kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
        if kind in REFUSED:
            raise ValueError(
                f"ClipampAccelerate does not support {kind} (it clips inside its engine); "
                "use accelerator.clip_grad_norm_ there"
            )
        self.accelerator, self.total_steps = accelerator, total_steps
        self.recorder = StepRecorder(
            apply=apply,
            calibrate=calibrate,
            csv_path=csv_path,
            tracking=tracking,
            experiment=experiment,
            run_name=run_name or "accelerate",
            skip_nonfinite=skip_nonfinite,
            verbose=verbose,
            spelling=ACCELERATE_SPELLING,
        )
        self.step = 0
        self._begun = False
        self._measured: Measured | None = None
        self._resume: dict[str, Any] | None = None  # the state load_state_dict got, for the next clip call
        self._hook = accelerator.register_load_state_pre_hook(self._loading)

    def state_dict(self) -> dict[str, Any]:
        """What ``accelerator.save_state`` keeps once ``accelerator.register_for_checkpointing(clipamp)``:
        the recorder's state at the last recorded step (JSON, ``sweep.integrations.resume``)."""
        return self.recorder.checkpoint_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """From ``accelerator.load_state``: the next ``clip_grad_norm_`` continues from ``state``."""
        self.step, self._begun, self._measured = int(state["step"]), False, None
        self._resume = state if self.step > 0 else None

    def _loading(self, models: Any, input_dir: str) -> None:
        """``accelerator.load_state``'s pre-hook: one line where it will not restore this object."""
        if not any(obj is self for obj in self.accelerator._custom_objects):
            where = "start afresh at step 1" if self.step == 0 else f"go on from step {self.step + 1}"
            warnings.warn(
                f"clipamp: accelerator.load_state({str(input_dir)!r}) does not restore ClipampAccelerate (not "
                f"registered for checkpointing): the calibration and the records {where}, not from the "
                "checkpoint; call accelerator.register_for_checkpointing(clipamp) before save_state and load_state",
                ResumeWarning,
                stacklevel=3,
            )

    @property
    def policy(self):
        return self.recorder.policy

    @property
    def summary(self):
        return self.recorder.summary

    def _begin(self, max_norm: float | None) -> None:
        self.recorder.begin(
            total_steps=self.total_steps,
            user_tau=max_norm,
            default_csv=Path("clipamp") / "steps.csv",
            main_process=self.accelerator.is_main_process,
            tags={"run": "accelerate", "dtype": self._dtype(), "precision": str(self.accelerator.mixed_precision)},
            params={
                **{f"calibrate.{k}": v for k, v in self.recorder.options.items() if k != "cap"},
                "apply": self.recorder.apply,
                "max_grad_norm": max_norm,
                "gradient_accumulation_steps": self.accelerator.gradient_accumulation_steps,
            },
            resume=self._resume,
        )
        self._resume, self._begun = None, True

    def _dtype(self) -> str:
        """The dtype the forward runs in: accelerate autocasts (``native_amp``) only where its mixed precision runs
        natively; ``mixed_precision="fp16"`` on a CPU trains in fp32."""
        return str(self.accelerator.mixed_precision) if self.accelerator.native_amp else "fp32"

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float | None, norm_type: float = 2
    ) -> torch.Tensor:
        """Unscale, norm and clip as ``accelerator.clip_grad_norm_`` (or at the calibrated τ); the pre-clip norm.
        ``norm_type`` is accelerate's argument: the L2 norm (2) is the one clipamp records and calibrates."""
        if norm_type != 2:
            raise ValueError(
                f"norm_type={norm_type!r}: ClipampAccelerate records and calibrates the global L2 norm "
                "(norm_type=2); call accelerator.clip_grad_norm_ for another norm"
            )
        if max_norm is not None and not max_norm > 0:  # torch's coefficient max_norm/‖g‖ would be ≤ 0
            raise ValueError(
                f"max_norm={max_norm!r}: accelerator.clip_grad_norm_ would multiply every gradient by "
                "max_norm/‖g‖ (0 zeroes them, a negative flips them); pass max_norm=None to record without "
                "clipping, or a τ > 0"
            )
        if not self._begun:
            self._begin(max_norm)
        elif not self.recorder.apply:  # the τ of this call, as accelerate would clip at it
            self.recorder.set_user_tau(max_norm)
        params = list(parameters)
        self.accelerator.unscale_gradients()
        self._lr = float(self._optimizer_lr())
        scaler = getattr(self.accelerator, "scaler", None)
        self._scale = float(scaler.get_scale()) if scaler is not None else 1.0  # sync (fp16): this step's scale
        self._measured = self.recorder.measure(params, self.step + 1, host_clips=False)
        return torch.tensor(self._measured.pre)

    def _optimizer_lr(self) -> float:
        optimizers = getattr(self.accelerator, "_optimizers", [])
        return optimizers[0].param_groups[0]["lr"] if optimizers else float("nan")

    def step_end(self, loss: torch.Tensor | float | None = None) -> None:
        """After ``optimizer.step()`` of a synchronising step: the step's record (``loss``: the loss you pass,
        e.g. the last micro-batch's under accumulation)."""
        if self._measured is None:
            raise RuntimeError("step_end() without clip_grad_norm_() in this optimizer step")
        m, self._measured = self._measured, None
        if loss is not None:
            m.loss = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)  # sync: once per step
        self.step += 1
        skipped = bool(self.accelerator.optimizer_step_was_skipped)
        self.recorder.record(self.step, self._lr, m, scale=self._scale, skipped=skipped)

    def end(self) -> dict[str, float]:
        """Close the CSV and the MLflow run; the summary metrics (the verdict is printed)."""
        self._hook.remove()
        return self.recorder.end(self.step) if self._begun else {}
