"""``+experiment=train calibrate.quantile=null``: the summary's τ is the band's quantile, not a traceback."""

import numpy as np
import pytest

from clipamp_engine.band import band_quantile
from sweep.run.loop import RunRecords
from sweep.run.summary import summary_metrics
from tests.app.helpers import compose_cfg


def test_a_train_run_with_quantile_null_recommends_the_band_quantile():
    cfg = compose_cfg("+experiment=train", "calibrate.quantile=null")
    assert cfg.calibrate.quantile is None
    norms = np.linspace(0.5, 2.0, 50)
    rows = [
        {"step": i + 1, "grad_l2_pre_clip": float(n), "skipped": False, "clipped": False, "loss": 1.0}
        for i, n in enumerate(norms)
    ]
    metrics = summary_metrics(cfg, RunRecords(rows), [])
    q = band_quantile(tuple(cfg.calibrate.target_clip))
    assert metrics["recommended_max_norm"] == pytest.approx(np.quantile(norms, q))
