"""The constrained study's Wilcoxon pruner: SciPy's p-value and Optuna's decisions, without SciPy's 2**n
statistic calls on tied windows (one check at n = 13 took ~5 s)."""

from __future__ import annotations

import time

import numpy as np
import optuna
import pytest
import scipy.stats as ss

from sweep.experiments.study.wilcoxon import WilcoxonPruner, wilcoxon_p

TIED = [-2.0, -1.5, -1.0, -0.25, 0.0, 0.0, 0.25, 1.0, 1.5, 2.0, 3.0]  # zeros and ties: SciPy permutes


def samples(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [rng.choice(TIED, size=n), rng.normal(size=n).round(1), rng.normal(size=n), np.zeros(n)]


@pytest.mark.parametrize("n", range(2, 9))
def test_p_value_is_scipys_exactly(n):
    rng = np.random.default_rng(n)
    for _ in range(3):
        for d in samples(n, rng):
            for alt in ("greater", "less"):
                want = ss.wilcoxon(d, alternative=alt, zero_method="zsplit").pvalue
                assert wilcoxon_p(d, alt) == want, (d, alt)


def test_thirteen_tied_windows_cost_milliseconds_not_seconds():
    d = np.array([0.0] * 5 + [0.5, -0.5, 1.0, 1.0, 2.0, -2.0, 3.0, 0.25])  # 13 windows: 8,192 sign flips
    t = time.perf_counter()
    p = wilcoxon_p(d, "greater")
    assert time.perf_counter() - t < 0.5  # SciPy's permutation_test: ~5 s here
    # |d| ranks: zeros 1..5, 0.25 6, 0.5s 7.5, 1.0s 9.5, 2.0s 11.5, 3.0 13; zsplit: R+ gets half the zeros' (7.5)
    r_plus = 7.5 + 6 + 7.5 + 9.5 + 9.5 + 11.5 + 13
    flips = np.array([[(k >> i) & 1 for i in range(13)] for k in range(2**13)])
    ranks = ss.rankdata(np.abs(d))
    null = ((np.where(flips == 1, -d, d) > 0) * ranks).sum(axis=1) + 7.5
    assert p == np.mean(null >= r_plus - 1e-9)


def test_decisions_are_optunas_on_a_study_with_tied_windows():
    rng = np.random.default_rng(0)
    for direction in ("minimize", "maximize"):
        study = optuna.create_study(direction=direction)
        best = {s: float(v) for s, v in enumerate(rng.normal(3, 0.5, 8))}
        study.add_trial(optuna.trial.create_trial(value=2.0, intermediate_values=best))
        mine, optunas = (
            WilcoxonPruner(p_threshold=0.05, n_startup_steps=2),
            optuna.pruners.WilcoxonPruner(p_threshold=0.05, n_startup_steps=2),
        )
        decisions = set()
        for shift, n in [(0.0, 8), (0.3, 8), (-0.3, 8), (0.3, 3), (0.8, 6), (0.0, 1)]:
            values = {s: best[s] + (shift if s % 3 else 0.0) for s in range(n)}  # every third window tied
            trial = optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING, intermediate_values=values)
            decision = mine.prune(study, trial)
            assert decision == optunas.prune(study, trial), (direction, shift, n)
            decisions.add(decision)
        assert decisions == {True, False}  # both outcomes compared
