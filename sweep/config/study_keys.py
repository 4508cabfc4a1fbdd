"""``study.*`` keys one study mode reads and another would ignore: given on the command line with the
other mode, each is refused in one line (as ``validate.refuse_pruning_overrides`` does for pruning)."""

from __future__ import annotations

import dataclasses

from sweep.config.keys import given
from sweep.config.schema import StudyConfig
from sweep.errors import UserError

#: Read only by ``study=entangle`` (the LR check's grid).
ENTANGLE_KEYS = ("study.lr_factors", "study.entangle_quantiles", "study.seeds")
#: Read by every mode, or refused elsewhere with their own message (pruning, nproc_per_trial).
_SHARED = ("study.mode", "study.threads", "study.nproc_per_trial", "study.pruner", "study.prune_warmup")
_SHARED += ("study.prune_below_after", "study.report_every")
#: Read only by the Optuna studies (pareto, constrained): the LR check runs a fixed grid, no Optuna study,
#: and always its own calibration window (amp.dtype is its precision).
OPTUNA_KEYS = tuple(
    k
    for k in (f"study.{f.name}" for f in dataclasses.fields(StudyConfig))
    if k not in ENTANGLE_KEYS and k not in _SHARED
)


def refuse_other_mode_keys(run: str | None, mode: str, overrides: list[str]) -> None:
    """A command-line ``study.*`` key the sweep's mode would ignore: one line naming it and the fix."""
    if run != "sweep":
        return
    for text, key, _ in given(overrides):
        if mode == "entangle" and key in OPTUNA_KEYS:
            hint = "; amp.dtype= sets its precision" if key == "study.dtypes" else ""
            raise UserError(
                f"{text}: study=entangle runs a fixed grid (optim.lr × study.lr_factors by τ ∈ none and "
                f"study.entangle_quantiles of its own calibration window), not an Optuna study, so it would be "
                f"ignored{hint}: drop it, or pass study=pareto or study=constrained"
            )
        if mode != "entangle" and key in ENTANGLE_KEYS:
            raise UserError(
                f"{text}: only study=entangle (the LR check) reads it, so study={mode} would ignore it: drop it, "
                "or pass study=entangle"
            )


#: The ``max_norm`` range keys of each kind of search space: a fixed range, or one anchored on norm quantiles.
FIXED_RANGE_KEYS = ("study.max_norm_low", "study.max_norm_high")
ANCHORED_RANGE_KEYS = ("study.anchor_low", "study.anchor_high")


def refuse_other_range_keys(run: str | None, mode: str, anchor: str | None, overrides: list[str]) -> None:
    """A command-line range key of the search space the study does not use: ``study.max_norm_low/high`` with
    an anchor (the range is ``[anchor_low × p50, anchor_high × p99]``), ``study.anchor_low/high`` without one."""
    if run != "sweep" or mode == "entangle":  # entangle refuses both (``refuse_other_mode_keys``)
        return
    for text, key, _ in given(overrides):
        if anchor is not None and key in FIXED_RANGE_KEYS:
            raise UserError(
                f"{text}: with study.anchor={anchor} the max_norm range is [study.anchor_low × p50, "
                "study.anchor_high × p99] of the anchor's norms, so it would be ignored: pass study.anchor=null "
                "to search [study.max_norm_low, study.max_norm_high], or drop it"
            )
        if anchor is None and key in ANCHORED_RANGE_KEYS:
            raise UserError(
                f"{text}: study.anchor=null searches [study.max_norm_low, study.max_norm_high], so it would be "
                "ignored: drop it, or pass study.anchor=window (or a calibrate run's id) to anchor the range"
            )
