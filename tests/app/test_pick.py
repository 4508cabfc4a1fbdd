"""The pick rule and the Pareto front on hand-made trial tables (``sweep.pick``)."""

from __future__ import annotations

import math

import pandas as pd

from sweep.pick import pareto_mask, pick_trial


def table(*rows) -> pd.DataFrame:
    cols = ["trial", "state", "dtype", "max_norm", "eval_loss", "clip_ratio"]
    return pd.DataFrame([dict(zip(cols, r)) for r in rows], columns=cols)


NAN = math.nan
HAND = table(
    (0, "COMPLETE", "bf16", 0.5, 2.0, 0.9),
    (1, "COMPLETE", "fp16", 1.0, 2.2, 0.15),
    (2, "COMPLETE", "bf16", 1.5, 2.1, 0.05),
    (3, "PRUNED", "bf16", 2.0, 1.0, 0.1),  # better, in band, but pruned: never picked
    (4, "FAIL", "fp16", 3.0, NAN, NAN),
    (5, "COMPLETE", "bf16", 9.0, 1.9, 0.0),  # lowest loss, but below the band
    (6, "COMPLETE", "fp16", 4.0, NAN, 0.1),  # non-finite eval loss: not a candidate
)


def test_pick_lowest_eval_loss_in_band():
    p = pick_trial(HAND, (0.01, 0.2))
    assert (p.trial, p.dtype, p.max_norm, p.rule) == (2, "bf16", 1.5, "in-band-min-loss")


def test_pick_falls_back_to_nearest_band_then_none():
    p = pick_trial(HAND[HAND["trial"].isin([0, 3, 4, 5])], (0.01, 0.2))
    assert (p.trial, p.rule) == (5, "nearest-band")  # |0.0 - 0.01| < |0.9 - 0.2|
    p = pick_trial(HAND[HAND["trial"].isin([0, 5])], (0.5, 0.6))
    assert (p.trial, p.rule) == (0, "nearest-band")  # 0.3 away beats 0.5 away
    assert pick_trial(HAND[HAND["state"] != "COMPLETE"], (0.01, 0.2)) is None
    assert pick_trial(HAND.iloc[:0], (0.01, 0.2)) is None


def test_pick_ties_prefer_less_clipping_then_earlier_trial():
    t = table(
        (0, "COMPLETE", "fp16", 1.0, 2.0, 0.15),
        (1, "COMPLETE", "bf16", 2.0, 2.0, 0.05),
        (2, "COMPLETE", "fp16", 3.0, 2.0, 0.05),
    )
    assert pick_trial(t, (0.0, 0.2)).trial == 1


def test_pareto_mask_is_the_non_dominated_set():
    assert pareto_mask([1.0, 2.0, 3.0, 1.5, 1.0], [0.5, 0.1, 0.0, 0.6, 0.5]) == [True, True, True, False, True]
