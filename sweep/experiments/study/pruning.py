"""The constrained study's pruner: Optuna's loss pruners (``WilcoxonPruner``, ``MedianPruner``) behind a band rule.

A trial of ``study=constrained`` is picked only if its clipping ratio ends in ``study.target_clip=[low,
high]`` (``sweep.pick.PICK_RULES``), so a trial whose ratio can no longer end there is pruned whatever its
loss (``band_verdict``):

- above the band: the clipped steps so far already exceed ``high`` × every step the run can take, even if
  none of the remaining steps clips: the final ratio is above ``high`` for certain;
- below the band: after ``study.prune_below_after`` of its steps, the ratio so far is under ``low``. With a
  fixed threshold, gradient norms are largest early in a run (initial loss, LR warm-up), so the realised
  ratio falls as the run goes on and a run already under the band does not climb back into it. This half
  is an assumption, not a certainty: norms that rise late (they do as a cosine LR decays, Defazio,
  arXiv:2506.02285) can lift a ratio back into the band; ``study.prune_below_after=null`` turns it off.
  Because it is a guess, it waits for a feasible trial (COMPLETE, ratio in the band): until the study has
  one, a trial below the band so far runs on, so the guess never leaves a study with no pick (seen:
  ``model=lstm steps=60``, every trial pruned at 0 clipped of 6 steps, one of which ended at 11.7%).

Otherwise the inner pruner decides on the training loss, reported as the mean over each
``study.report_every`` steps (one value per window of batches; every trial sees the same batches):

- ``wilcoxon`` (default): Optuna's ``WilcoxonPruner`` (its p-value computed without SciPy's 2**n calls on
  tied windows: ``sweep.experiments.study.wilcoxon``): a one-sided Wilcoxon signed-rank test of the
  trial's windows against the same windows of the study's best trial (``study.best_trial``: the best
  feasible completed one, the trial the pick would take today); pruned at p < 0.05. It only stops a
  trial that is consistently worse than the incumbent, so not a trial that would replace it;
- ``median``: Optuna's ``MedianPruner``: worse than the completed trials' median at the same step,
  once as many trials as there are dtypes have completed (of any dtype).

Both wait ``study.prune_warmup`` of the steps, and compare across dtypes on purpose: the pick ranks
every dtype by the one eval loss.

The rule reads the trial's clip counts from its user attribute ``CLIP_COUNTS`` (``[step, taken, clipped]``),
which the trial writes before it asks ``trial.should_prune()``.

References: Optuna ``BasePruner``, ``MedianPruner``, ``WilcoxonPruner`` (Akiba et al., KDD 2019; Wilcoxon,
"Individual comparisons by ranking methods", 1945); constrained TPE sees the same ratios through
``trial.set_constraint`` (Watanabe & Hutter, 2023).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import optuna

from sweep.experiments.study.wilcoxon import WilcoxonPruner

#: The trial user attribute holding ``[step, taken, clipped]``: steps run, steps taken (not skipped), clipped.
CLIP_COUNTS = "clip_counts"


def band_verdict(
    step: int,
    taken: int,
    clipped: int,
    steps: int,
    band: Sequence[float],
    below_after: int | None,
) -> str | None:
    """``"above"`` / ``"below"`` when a trial's clipping ratio can no longer end in ``band``, else None.

    Args:
        step: steps the trial has run (skipped ones included), of ``steps``.
        taken: steps taken (not skipped) so far; the ratio is clipped / taken.
        clipped: taken steps that were clipped.
        steps: the trial's full length.
        band: ``[low, high]``.
        below_after: the step from which a ratio so far under ``low`` prunes (None: never).
    """
    low, high = band
    if clipped > high * (taken + steps - step):  # even with no clip from here on, the ratio ends above high
        return "above"
    if below_after is not None and step >= below_after and taken and clipped < low * taken:
        return "below"
    return None


class BandPruner(optuna.pruners.BasePruner):
    """Prune when ``band_verdict`` says the trial's clipping ratio cannot end in the band, else ask ``inner``."""

    def __init__(
        self, inner: optuna.pruners.BasePruner, band: Sequence[float], steps: int, below_after: int | None
    ) -> None:
        self.inner, self.band, self.steps, self.below_after = inner, tuple(band), steps, below_after
        self._feasible = False  # the study has a feasible trial (read from the storage until it has)

    def verdict(self, trial: optuna.trial.FrozenTrial) -> str | None:
        counts = trial.user_attrs.get(CLIP_COUNTS)
        if not counts:
            return None
        step, taken, clipped = counts
        return band_verdict(step, taken, clipped, self.steps, self.band, self.below_after)

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        verdict = self.verdict(trial)
        if verdict == "above" or verdict == "below" and self.has_feasible(study):
            return True
        return self.inner.prune(study, trial)

    def has_feasible(self, study: optuna.Study) -> bool:
        """A COMPLETE trial whose constraints all hold (its clipping ratio ended in the band); once true,
        it stays true for the study, so it is read from the storage until then only."""
        if not self._feasible:
            done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            self._feasible = any(t.constraints and all(v <= 0 for v in t.constraints.values()) for t in done)
        return self._feasible


def seconds_saved(left: int, ran: int, starts: Sequence[float], stopped: float | None) -> float:
    """A pruned trial's ``left`` steps not run × its own time per step in its training loop.

    The time per step runs from the start of its second step (``starts[1]``) to the prune (``stopped``)
    over the ``ran - 1`` steps between, so neither the trial's start-up (model, data, its MLflow run) nor
    its first step's warm-up counts as per-step time; from the first step's start when it ran one step.
    """
    if stopped is None or not starts:
        return 0.0  # not stopped by the pruner (or no step started): no per-step time measured
    if ran >= 2 and len(starts) >= 2:
        return left * (stopped - starts[1]) / (ran - 1)
    return left * (stopped - starts[0]) / max(1, ran)


#: The loss pruner's p-value threshold (``WilcoxonPruner``): pruned when worse than the best trial at p < this.
P_THRESHOLD = 0.05


def constrained_pruner(
    kind: str,
    steps: int,
    n_dtypes: int,
    band: Sequence[float],
    *,
    warmup: float,
    report_every: int,
    below_after: float | None,
) -> BandPruner:
    """The band rule over the loss pruner ``kind`` (``wilcoxon`` | ``median``), which waits ``warmup`` of the
    steps; ``below_after`` is a fraction of the steps (None: no below-band rule)."""
    if kind == "wilcoxon":
        reports = max(2, math.ceil(warmup * steps / report_every))  # the test needs two paired windows
        inner = WilcoxonPruner(p_threshold=P_THRESHOLD, n_startup_steps=reports)
    else:
        inner = optuna.pruners.MedianPruner(
            n_startup_trials=n_dtypes, n_min_trials=n_dtypes, n_warmup_steps=int(warmup * steps), interval_steps=1
        )
    return BandPruner(inner, band, steps, None if below_after is None else max(1, int(below_after * steps)))
