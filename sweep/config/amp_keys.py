"""``amp.*`` loss-scaler keys given on the command line of a run that scales no loss (bf16, fp32): refused in
one line, as ``study_keys`` refuses the study keys a mode ignores. A sweep and a spike replay train fp16 beside
bf16 (``study.dtypes``, the replay's fp16 arms), and a multirun that sweeps ``amp.dtype`` (or ``amp``) sets
them for its fp16 jobs: those keep them."""

from __future__ import annotations

import dataclasses

from sweep.config.keys import given
from sweep.config.schema import AmpConfig
from sweep.errors import UserError

#: The loss scaler's settings (``HysteresisScaler``): read only when ``amp.dtype=fp16``.
SCALER_KEYS = tuple(f"amp.{f.name}" for f in dataclasses.fields(AmpConfig) if f.name != "dtype")


def refuse_scaler_keys(run: str | None, dtype: str, job: list[str], overrides: list[str]) -> None:
    """A command-line scaler key of a train or calibrate run in ``dtype`` other than fp16: one line naming it
    and the fix. ``job``: the run's overrides; ``overrides``: the command's (a ``-m`` sweep of the dtype)."""
    if run not in ("train", "calibrate") or dtype == "fp16":
        return
    if any(key in ("amp", "amp.dtype") and "," in value for _, key, value in given(overrides)):
        return  # -m amp.dtype=fp16,bf16: the key is for the fp16 jobs
    for text, key, _ in given(job):
        if key in SCALER_KEYS:
            raise UserError(
                f"{text}: the loss scaler runs under amp.dtype=fp16 only ({dtype} scales no loss), so this "
                f"{dtype} run would ignore it: drop it, or pass amp.dtype=fp16"
            )
