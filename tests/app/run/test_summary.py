"""A run's summary metrics name their quantiles as the engine's calibration summary does."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from clipamp_engine.band import band_quantile
from clipamp_engine.calibration import REPORTED_QUANTILES, NormCalibrator, quantile_label
from sweep.run.loop import RunRecords
from sweep.run.summary import QUANTILE_KEYS, summary_metrics


@pytest.mark.parametrize(
    ("q", "label"),
    [
        (0.5, "p50"),
        (0.9, "p90"),
        (0.95, "p95"),
        (0.975, "p97.5"),
        (0.99, "p99"),
        (0.999, "p99.9"),
        (0.99999, "p99.999"),  # not rounded up to p100
        (0.07, "p7"),  # 0.07 * 100 = 7.000000000000001
        (band_quantile([0.01, 0.05]), "p97"),  # the band's quantile, 0.97000000000000003
    ],
)
def test_quantile_label(q, label):
    assert quantile_label(q) == label


def test_a_windows_chosen_quantile_is_keyed_by_its_label():
    calibrator = NormCalibrator(quantile=0.975)
    for step, norm in enumerate(np.random.default_rng(1).lognormal(size=200).tolist(), start=1):
        calibrator.add(SimpleNamespace(step=step, skipped=False, grad_l2_pre_clip=norm, token_count=0))
    window = calibrator.summary()
    assert list(window.cis) == [*QUANTILE_KEYS, "p97.5"]
    assert window.tau_ci.estimate == window.recommended_max_norm == pytest.approx(np.quantile(calibrator.norms, 0.975))


def test_labels_are_the_engine_summarys_keys():
    norms = np.random.default_rng(0).lognormal(size=40).tolist()
    calibrator = NormCalibrator(quantile=0.9)
    for step, norm in enumerate(norms + [math.inf], start=1):
        calibrator.add(SimpleNamespace(step=step, skipped=False, grad_l2_pre_clip=norm, token_count=0))
    window = calibrator.summary()
    assert QUANTILE_KEYS == ("p50", "p90", "p95", "p99") and len(QUANTILE_KEYS) == len(REPORTED_QUANTILES)
    assert list(window.quantiles) == [*QUANTILE_KEYS, "max"]

    # the same norms summarised without a window (clip=fixed/none): same metric names, same values
    rows = [
        dict(step=s, skipped=False, phase="train", clipped=False, grad_l2_pre_clip=n, loss=1.0)
        for s, n in enumerate(norms, 1)
    ]
    cfg = SimpleNamespace(calibrate=SimpleNamespace(quantile=0.9))
    plain = summary_metrics(cfg, RunRecords(rows), [])
    windowed = summary_metrics(cfg, RunRecords(rows), [window])
    names = [f"grad_norm_{k}" for k in (*QUANTILE_KEYS, "max")]
    assert [plain[k] for k in names] == pytest.approx([windowed[k] for k in names], rel=0, abs=0)
    assert plain["recommended_max_norm"] == windowed["recommended_max_norm"] == window.recommended_max_norm
