"""``ClipampAccelerate.end()`` of a loop that stops before its ``total_steps`` says so in one line with what the stop
cut from the check of τ (the figures against the full loop's), and keeps every step it took: the CSV, the MLflow
run's per-step metrics, the line as its tag and in ``quantiles.json``."""

from __future__ import annotations

import json

import pytest
import torch

TOTAL, WINDOW, STOP = 60, 10, 30


def loop(tmp_path, steps: int, tracking=None):
    """``steps`` steps of a one-weight model whose gradient norms vary, through accelerate's clip call."""
    accelerate = pytest.importorskip("accelerate")
    from sweep.integrations.accelerate import ClipampAccelerate

    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    clipamp = ClipampAccelerate(
        accelerator, total_steps=TOTAL, tracking=tracking, csv_path=tmp_path / "steps.csv", window=WINDOW, start=0
    )
    for step in range(1, steps + 1):
        model.weight.grad = torch.tensor([[1.0 + (step * 7919 % 13) / 10]])
        clipamp.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        clipamp.step_end(0.0)
    run_id = clipamp.recorder.tracker.run_id if tracking else None
    clipamp.end()
    return clipamp, run_id


def test_a_loop_stopped_before_total_steps_says_what_its_check_covered(tmp_path, store, capsys):
    from mlflow import MlflowClient

    full, _ = loop(tmp_path / "full", TOTAL)
    planned = full.recorder.policy.checks()[0].steps
    assert planned == TOTAL - WINDOW
    capsys.readouterr()
    cut, run_id = loop(tmp_path, STOP, tracking=store)
    taken = cut.recorder.policy.checks()[0].steps
    tau = cut.recorder.tau
    assert tau == full.recorder.tau and taken == STOP - WINDOW
    line = (
        f"the run stopped at step {STOP} of total_steps={TOTAL}: the check of τ={tau:.4g} covered {taken} held-out "
        f"steps instead of {planned}"
    )
    said = capsys.readouterr().out.splitlines()
    assert [s for s in said if s.startswith("clipamp: the run stopped")] == [f"clipamp: {line}"], said
    client = MlflowClient(store)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["stopped_early"] == line
    steps = [m.step for m in client.get_metric_history(run_id, "grad_l2_pre_clip")]
    assert sorted(steps) == list(range(1, STOP + 1))  # every step taken, none lost
    csv = client.download_artifacts(run_id, "steps.csv", str(tmp_path))
    assert [r.split(",")[0] for r in open(csv).read().splitlines()[1:]] == [str(s) for s in range(1, STOP + 1)]
    payload = json.loads(open(client.download_artifacts(run_id, "quantiles.json", str(tmp_path))).read())
    assert payload["stopped_early"] == line


def test_a_loop_that_ran_its_length_says_nothing_of_a_stop(tmp_path, capsys):
    loop(tmp_path, TOTAL)
    assert "the run stopped" not in capsys.readouterr().out
