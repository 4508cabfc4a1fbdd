"""model=hf through kill and resume: a calibrate run on a jsonl (tokenizer trained from it) stopped
by SIGTERM and resumed with ``resume=true`` equals an uninterrupted run with the same seed."""

from __future__ import annotations

import signal

import pandas as pd
import pytest
from mlflow import MlflowClient

from tests.app.run.test_kill_resume import _complete_steps, _wait_rows
from tests.app.tasks.test_hf import write_corpus
from tests.app.tasks.test_hf_e2e import HF_TINY

pytestmark = pytest.mark.slow  # end to end: three real CLI runs

# window at steps 1-6 (tau from its p95), then training at tau; constant LR: the killed run has a
# different `steps` than the control, and a cosine schedule's length follows `steps`
RUN = [
    "+experiment=calibrate",
    "model=hf_llama",
    "data=hf",
    "data.source_field=source",
    "calibrate.start=0",
    "calibrate.window=6",
    "calibrate.quantile=0.95",
    "seed=3",
    "optim.schedule=constant",
    "optim.warmup_steps=2",
    *HF_TINY,
]


def test_sigterm_then_resume_equals_an_uninterrupted_hf_run(tmp_path, store, monkeypatch):
    import tests.app.run.test_kill_resume as K

    corpus = write_corpus(tmp_path / "corpus.jsonl")
    monkeypatch.setattr(K, "RUN", [*RUN, f"data.files={corpus}"])
    proc, csv = K._start(tmp_path, "steps=100000", "checkpoint_every=0")
    _wait_rows(csv, 9, timeout=300)  # past the window: tau is in force when the signal lands
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    n = _complete_steps(csv)[-1]
    assert _complete_steps(csv) == list(range(1, n + 1)) and n >= 9
    run_id = csv.parts[-3]
    client = MlflowClient(store)
    assert client.get_run(run_id).info.status == "KILLED"

    # the corpus edited since: the same config would train on other data with another tokenizer; refused
    original = corpus.read_text()
    corpus.write_text(original + '{"text": "return self while yield", "source": "code", "id": 400}\n')
    other = K._cli(tmp_path, f"steps={n + 5}", "resume=true")
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-2000:]
    assert (
        other.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: resume={run_id}: the data or model differ from the run's, though the config is the same")
    )
    assert _complete_steps(csv)[-1] == n and client.get_run(run_id).info.status == "KILLED"  # nothing touched
    corpus.write_text(original)

    res = K._cli(tmp_path, f"steps={n + 5}", "resume=true")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resumed run {run_id} at step {n}" in res.stdout
    assert _complete_steps(csv) == list(range(1, n + 6))  # every step once
    assert client.get_run(run_id).info.status == "FINISHED"

    fresh = K._cli(tmp_path, f"steps={n + 5}")  # the same run, never interrupted
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    control_id = next(
        r.info.run_id
        for r in client.search_runs([client.get_run(run_id).info.experiment_id])
        if r.info.run_id != run_id
    )
    resumed, control = pd.read_csv(csv), pd.read_csv(csv.parents[2] / control_id / "artifacts" / "steps.csv")
    assert len(resumed) == len(control) == n + 5
    for col in ("loss", "grad_l2_pre_clip", "grad_l2_post_clip", "lr", "token_count", "scaler_scale"):
        assert resumed[col].to_numpy() == pytest.approx(control[col].to_numpy(), rel=1e-5), col
    assert resumed["data_source"].tolist() == control["data_source"].tolist()
    assert resumed["max_norm"].fillna(-1).tolist() == pytest.approx(control["max_norm"].fillna(-1).tolist(), rel=1e-5)
    tau = [client.get_run(r).data.metrics["recommended_max_norm"] for r in (run_id, control_id)]
    assert tau[0] == pytest.approx(tau[1], rel=1e-5)
    assert resumed["max_norm"].iloc[6:].tolist() == pytest.approx([tau[0]] * (n - 1), rel=1e-5)  # tau after the window
