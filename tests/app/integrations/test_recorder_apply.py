"""``StepRecorder(apply=True)`` clips as the host would at the policy's τ: the norm and the clip of
``torch.nn.utils.clip_grad_norm_`` (what ``Trainer`` and ``accelerate`` call), bit for bit, bf16 and fp16
gradients included (torch norms them in their own dtype), before the window closes and after."""

from __future__ import annotations

import pytest
import torch

from sweep.integrations.recorder import StepRecorder

WINDOW, STEPS, TAU = 4, 10, 0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_apply_clips_as_clip_grad_norm_does(tmp_path, dtype):
    rec = StepRecorder(apply=True, calibrate={"window": WINDOW, "start": 0}, tracking=None, verbose=False)
    rec.begin(total_steps=STEPS, user_tau=TAU, default_csv=tmp_path / "steps.csv")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (7, 300, 33)]
    for step in range(1, STEPS + 1):
        grads = [torch.randn(p.shape).mul(0.05 * step).to(dtype) for p in params]
        mine = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        for p, g in zip(mine, grads):
            p.grad = g.clone()
        tau = rec.clip_in_force()
        assert tau == (TAU if step <= WINDOW else rec.tau)
        expected = torch.nn.utils.clip_grad_norm_(mine, tau)
        m = rec.measure(params, step, host_clips=False)
        rec.record(step, 1e-3, m)
        assert m.pre == float(expected), step
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(params, mine)), step
    assert rec.tau is not None and rec.tau != TAU  # the calibrated τ was applied after the window
    rec.end(STEPS)
