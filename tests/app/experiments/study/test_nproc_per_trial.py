"""``study.nproc_per_trial=2``: each trial of a sweep is a 2-rank torchrun job (gloo, CPU).

The same 2-trial study run with one-process trials is the reference: in fp32 every trial must get the
same parameters, its child run the same steps (rtol 1e-5), and Optuna the values the child run logged
to MLflow (read back, not recomputed), equal to the one-process trial's. What cannot work (pruning
a job whose steps the sweep process does not see) is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from sweep import app
from sweep.config import validate
from sweep.errors import UserError
from tests.app.experiments.study.test_sweep import children, optuna_study, sweep_cfg
from tests.app.helpers import store_in


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["study.nproc_per_trial=0"], "study.nproc_per_trial=0 must be >= 1"),
        (
            ["study.nproc_per_trial=2", "study=constrained"],
            "study.nproc_per_trial=2: a trial runs as a torchrun job whose steps the sweep process does not see, so "
            "study.pruner=wilcoxon cannot stop it; pass study.pruner=none (or study.nproc_per_trial=1)",
        ),
        (["study.nproc_per_trial=3"], "data.batch_size=4 does not split over study.nproc_per_trial=3 ranks"),
        (["study.nproc_per_trial=2", "study=entangle"], "study.nproc_per_trial=2: study=entangle runs its grid"),
        (["study.nproc_per_trial=2", "dist.strategy=none"], "study.nproc_per_trial=2 needs dist.strategy=auto"),
        (  # before: the study and its parent run were made, then the first trial's job failed in the engine's words
            ["study.nproc_per_trial=2", "dist.strategy=fsdp2", "forensics.update_norm=true", "forensics.top_k=2"],
            "study.nproc_per_trial=2 with dist.strategy=fsdp2: forensics (forensics.update_norm=true "
            "forensics.top_k=2) needs whole (unsharded) parameters, which FSDP2 does not keep: turn it off "
            "(forensics.update_norm=false forensics.top_k=0) or use dist.strategy=ddp",
        ),
    ],
)
def test_what_torchrun_trials_cannot_do_is_one_line(overrides, message):
    with pytest.raises(UserError) as e:
        validate(sweep_cfg("sqlite:///unused.db", *overrides))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_constrained_torchrun_trials_without_pruner_are_accepted():
    validate(sweep_cfg("sqlite:///unused.db", "study.nproc_per_trial=2", "study=constrained", "study.pruner=none"))


def _sweep(root: Path, nproc: int, template: Path):
    uri = store_in(root, template)  # root/mlruns/mlflow.db, migrated already
    cfg = sweep_cfg(
        uri, "study.anchor=null", "study.n_trials=2", "study.dtypes=[fp32]", f"study.nproc_per_trial={nproc}"
    )
    result = app.run(cfg, ["+experiment=sweep"])
    client = MlflowClient(uri)
    runs = {int(r.data.tags["trial"]): r for r in children(client, result.parent_run_id)}
    rows = {n: pd.read_csv(client.download_artifacts(r.info.run_id, "steps.csv", str(root))) for n, r in runs.items()}
    return optuna_study(result, root).trials, runs, rows


@pytest.mark.slow
def test_torchrun_trials_are_the_one_process_trials(tmp_path, store_template):
    ref_trials, ref_runs, ref_rows = _sweep(tmp_path / "one", 1, store_template)
    trials, runs, rows = _sweep(tmp_path / "two", 2, store_template)
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert sorted(runs) == [0, 1]
    for t, ref in zip(trials, ref_trials):
        run = runs[t.number]
        assert t.params == ref.params  # same seeded sampler, same history
        assert run.info.status == "FINISHED" and t.user_attrs["run_id"] == run.info.run_id
        assert (run.data.tags["ranks"], ref_runs[t.number].data.tags["ranks"]) == ("2", "1")  # a 2-rank torchrun job
        # Optuna's values are the child run's logged metrics (pareto: eval loss, clipping ratio)
        assert t.values == [run.data.metrics["eval_loss"], run.data.metrics["clip_ratio"]]
        assert t.user_attrs["steps_run"] == len(rows[t.number]) == 8
        torch.testing.assert_close(torch.tensor(t.values), torch.tensor(ref.values), rtol=1e-5, atol=1e-7)
        got, want = rows[t.number], ref_rows[t.number]
        assert got["step"].tolist() == want["step"].tolist() and got["clipped"].tolist() == want["clipped"].tolist()
        for col in ("grad_l2_pre_clip", "grad_l2_post_clip", "loss", "lr"):
            torch.testing.assert_close(
                torch.tensor(got[col].to_numpy()), torch.tensor(want[col].to_numpy()), rtol=1e-5, atol=1e-7, msg=col
            )


@pytest.mark.slow
def test_a_failed_trial_job_is_a_failed_trial_with_its_one_line(tmp_path, store, monkeypatch):
    monkeypatch.setenv("CLIPAMP_TEST_RANK_FAULT", "raise:1:3")  # the jobs' rank 1 raises at its 3rd step
    uri = store
    cfg = sweep_cfg(
        uri,
        "study.anchor=null",
        "study.n_trials=2",
        "study.dtypes=[fp32]",
        "study.nproc_per_trial=2",
        "model=custom",
        "model._target_=tests.app.run.rank_faults.RankFault",
    )
    result = app.run(cfg, ["+experiment=sweep"])  # the sweep goes on past failed trials, as in one process
    trials = optuna_study(result, tmp_path).trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.FAIL] * 2
    client = MlflowClient(uri)
    for t in trials:
        assert t.user_attrs["error"] == (
            "RuntimeError: rank 1 of 2 failed: RuntimeError: injected fault in forward "
            "at step 3; the run ended FAILED, steps.csv keeps steps 1–2; no checkpoint "
            "was written yet (checkpoint_every=): start a new run"
        )
        run = client.get_run(t.user_attrs["run_id"])
        assert run.info.status == "FAILED" and run.data.tags["ranks"] == "2"
        assert run.data.tags["mlflow.parentRunId"] == result.parent_run_id
