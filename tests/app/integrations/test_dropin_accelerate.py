"""``ClipampAccelerate``: its ``clip_grad_norm_`` in an accelerate loop changes nothing (``apply=False``)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

accelerate = pytest.importorskip("accelerate")

from sweep.integrations.accelerate import ClipampAccelerate  # noqa: E402
from tests.engine.nanogpt_shaped import NanoGPTShaped, batches, configure_optimizers  # noqa: E402

SIZE = dict(vocab=32, block=8, d=16, n_layer=1, n_head=2)


def backward(accelerator, model, x, y) -> torch.Tensor:
    """One micro-batch of the loops here: forward, the LM loss, ``accelerator.backward``; the loss."""
    logits, _ = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
    accelerator.backward(loss)
    return loss


def run(tmp_path, steps, tau, clipamp: bool):
    """An accelerate loop (bf16, accumulation 2) clipping at ``tau`` (a number, or a function of the
    optimizer step); returns (model, pre-clip norms)."""
    tau_at = tau if callable(tau) else (lambda step: tau)
    from accelerate import Accelerator

    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2, cpu=True)
    torch.manual_seed(0)
    model = NanoGPTShaped(**SIZE)
    optimizer = configure_optimizers(model)
    data = batches(2 * steps, batch=4, block=SIZE["block"], vocab=SIZE["vocab"])
    model, optimizer = accelerator.prepare(model, optimizer)
    cb = (
        ClipampAccelerate(accelerator, total_steps=steps, tracking=None, csv_path=tmp_path / "steps.csv")
        if clipamp
        else None
    )
    norms = []
    for x, y in data:
        with accelerator.accumulate(model):
            loss = backward(accelerator, model, x, y)
            if accelerator.sync_gradients:
                clip = cb.clip_grad_norm_ if cb else accelerator.clip_grad_norm_
                norms.append(float(clip(model.parameters(), tau_at(len(norms) + 1), norm_type=2)))  # accelerate's call
            optimizer.step()
            optimizer.zero_grad()
            if cb and accelerator.sync_gradients:
                cb.step_end(loss)
    if cb:
        cb.end()
    return model, norms


@pytest.mark.slow  # two accumulated bf16 loops through accelerate
def test_apply_false_changes_nothing_in_a_bf16_accumulated_loop(tmp_path):
    steps, tau = 20, 0.25
    ours, ours_norms = run(tmp_path, steps, tau, clipamp=True)
    ref, ref_norms = run(tmp_path, steps, tau, clipamp=False)
    assert len(ref_norms) == steps and ours_norms == ref_norms
    assert sum(n > tau for n in ref_norms) > steps / 2
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), name
    df = pd.read_csv(tmp_path / "steps.csv")
    assert df["grad_l2_pre_clip"].tolist() == ref_norms and df["step"].tolist() == list(range(1, steps + 1))
    assert df["loss"].notna().all()


def test_apply_false_follows_a_max_norm_that_changes_between_calls(tmp_path):
    """A loop that lowers its max_norm after 5 steps: each call clips at the τ it is given."""
    steps = 12
    schedule = lambda step: 1.0 if step <= 5 else 0.2  # noqa: E731
    ours, ours_norms = run(tmp_path, steps, schedule, clipamp=True)
    ref, ref_norms = run(tmp_path, steps, schedule, clipamp=False)
    assert ours_norms == ref_norms and any(n > 0.2 for n in ref_norms[5:])
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), name
    df = pd.read_csv(tmp_path / "steps.csv")
    assert df["max_norm"].tolist() == [1.0] * 5 + [0.2] * 7


def test_another_norm_type_is_refused_naming_the_call_to_use(tmp_path):
    from accelerate import Accelerator

    accelerate.state.AcceleratorState._reset_state(True)
    cb = ClipampAccelerate(Accelerator(cpu=True), tracking=None, csv_path=tmp_path / "steps.csv")
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"^norm_type=1: .* global L2 norm \(norm_type=2\); call accelerator"):
        cb.clip_grad_norm_(model.parameters(), 1.0, norm_type=1)
    assert not (tmp_path / "steps.csv").exists()


@pytest.mark.parametrize("max_norm", [0, 0.0, -1.0])
def test_a_max_norm_accelerate_would_zero_or_flip_gradients_with_is_refused(tmp_path, max_norm):
    """accelerate's clip at max_norm ≤ 0 scales every gradient by max_norm/‖g‖: the drop-in cannot both change
    nothing and skip that clip, so it says so before recording anything; max_norm=None records unclipped."""
    from accelerate import Accelerator

    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    accelerator.clip_grad_norm_(model.parameters(), max_norm)  # the call it replaces
    after = torch.cat([p.grad.flatten() for p in model.parameters()])
    before = torch.cat([g.flatten() for g in grads])
    if max_norm == 0:
        assert before.abs().sum() > 0 and torch.equal(after, torch.zeros_like(after))
    else:
        assert (after * before < 0).all()  # every gradient flipped
    cb = ClipampAccelerate(accelerator, tracking=None, csv_path=tmp_path / "steps.csv")
    with pytest.raises(
        ValueError,
        match=rf"^max_norm={max_norm!r}: accelerator.clip_grad_norm_ would multiply .* "
        r"pass max_norm=None to record without clipping",
    ):
        cb.clip_grad_norm_(model.parameters(), max_norm)
    assert not (tmp_path / "steps.csv").exists()


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_dtype_tag_is_what_the_forward_ran_in(tmp_path, store, precision):
    """``dtype`` (the report's and the MLflow view's column) is the precision autocast ran the forward in, seen
    from inside it: ``mixed_precision="fp16"`` on a CPU, where accelerate does not autocast, trains in fp32."""
    from accelerate import Accelerator
    from mlflow import MlflowClient

    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = Accelerator(mixed_precision=precision, cpu=True)
    seen = []
    layer = torch.nn.Linear(2, 1)
    layer.register_forward_pre_hook(lambda m, a: seen.append(torch.is_autocast_enabled("cpu")))
    model = accelerator.prepare(torch.nn.Sequential(layer))
    cb = ClipampAccelerate(accelerator, tracking=store, verbose=False)
    accelerator.backward(model(torch.ones(1, 2)).float().sum())
    cb.clip_grad_norm_(model.parameters(), 1.0)
    cb.step_end()
    cb.end()
    ran = precision if seen[0] else "fp32"  # autocast on, in the precision asked for, or off
    assert MlflowClient(store).get_run(cb.recorder.tracker.run_id).data.tags["dtype"] == ran
    assert ran == ("bf16" if precision == "bf16" else "fp32")
