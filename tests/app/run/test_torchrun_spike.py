"""``torchrun --nproc_per_node=2 -m sweep +experiment=spike`` (2 gloo ranks, DDP) against one process.

Every rank crafts the corrupted batch on the *global* batch (from the global pre-clip norms the
engine records) and trains on its share of it, so each arm must reproduce the one-process arm
step by step; rank 0 alone creates the parent run and the children. fp32 so that the two agree to
rounding; the fp16 pair is off (fp16 autocast rounds a half batch differently, and it would
double the test's time).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlflow
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from sweep.report.format import ui_command
from tests.app.helpers import TINY
from tests.app.run.test_torchrun import ENV, TORCHRUN

AT, STEPS = 16, 24
SPIKE = [
    "+experiment=spike",
    *TINY,
    "amp.dtype=fp32",
    "spike.fp16=false",
    f"steps={STEPS}",
    f"spike.at_step={AT}",
    "spike.horizons=[1,4,8]",
    "spike.peak_window=8",
    "calibrate.window=6",
    "calibrate.every=0",
    "optim.warmup_steps=3",
]
CHILDREN = {f"spike-{n}" for n in ("none-reference", "none", "fixed-reference", "fixed", "reference", "calibrated")}
#: what each child logs about the spike step, computed from its own rows and crafted batch
SPIKE_METRICS = (
    "spike_pre_clip_norm",
    "spike_running_peak",
    "spike_loss_multiplier",
    "spike_natural_norm",
    "loss_excess_1",
    "loss_excess_8",
)


def _spike(cmd: list[str], cwd: Path) -> tuple[MlflowClient, str, dict[str, object]]:
    """Run the replay in ``cwd``; its store, the one parent run's id and its children by name."""
    res = subprocess.run([*cmd, *SPIKE], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("spike: parent run ") == 1 and res.stdout.count("figure: ") == 1  # rank 0 prints
    uri = f"sqlite:///{cwd}/mlruns/mlflow.db"
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0].info.run_id
    ui = ui_command(uri, parents[0].info.experiment_id)  # the command every run prints, with its page
    assert f"runs: {ui}  (parent run {parent})" in res.stdout
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent}
    assert set(children) == CHILDREN and len(runs) == len(CHILDREN) + 1
    assert all(r.info.status == "FINISHED" for r in children.values())
    return client, uri, children


def _steps(uri: str, run, dst: Path) -> pd.DataFrame:
    path = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="steps.csv", dst_path=str(dst / run.info.run_id), tracking_uri=uri
    )
    return pd.read_csv(path)


@pytest.mark.slow
def test_spike_under_torchrun_is_the_one_process_replay(tmp_path):
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    _, uri1, one = _spike([sys.executable, "-m", "sweep"], tmp_path / "one")
    _, uri2, two = _spike(TORCHRUN, tmp_path / "two")
    for name in sorted(CHILDREN):
        want, got = _steps(uri1, one[name], tmp_path / "csv1"), _steps(uri2, two[name], tmp_path / "csv2")
        assert got["step"].tolist() == want["step"].tolist() == list(range(1, STEPS + 1)), name
        for col in ("skipped", "clipped", "token_count"):
            assert got[col].tolist() == want[col].tolist(), (name, col)  # token_count: global, not a share
        for col in ("grad_l2_pre_clip", "grad_l2_post_clip", "loss", "max_norm"):
            torch.testing.assert_close(
                torch.tensor(got[col].fillna(0).to_numpy()),
                torch.tensor(want[col].fillna(0).to_numpy()),
                rtol=1e-5,
                atol=1e-6,
                msg=f"{name} {col}",
            )
        assert two[name].data.tags["ranks"] == "2" and one[name].data.tags["ranks"] == "1"
        for key in SPIKE_METRICS:
            assert two[name].data.metrics[key] == pytest.approx(one[name].data.metrics[key], rel=1e-5, abs=1e-6), (
                name,
                key,
            )
    # the spike really hit the spiked arms: 20 × the running peak (global norms), where the twins saw none
    for name in ("none", "fixed", "calibrated"):
        m = two[f"spike-{name}"].data.metrics
        assert m["spike_pre_clip_norm"] == pytest.approx(20 * m["spike_running_peak"], rel=1e-3)
        assert (
            two[f"spike-{name}-reference" if name != "calibrated" else "spike-reference"].data.metrics[
                "spike_pre_clip_norm"
            ]
            < 3 * m["spike_running_peak"]
        )
