"""Fault matrix: every fault × {fp16, bf16, fp32} × accumulation {1, 4} on a small real model.

Afterwards parameters and optimizer state are finite, each faulty step is a SkipLog with the
right reason (or a clipped step for a finite spike), the fp16 scale backed off, and training
goes on: the loss ends near a fault-free control run's.
"""

from __future__ import annotations

import math

import pytest

from sweep.config.schema import FaultsConfig
from sweep.run.build import build_state
from sweep.run.checkpoint import non_finite_state
from sweep.run.faults import FAULTS, FaultInjector
from sweep.tasks.build import build_task
from tests.app.helpers import TINY, compose_cfg

FAULT_STEP, STEPS = 4, 12
MATRIX: list[tuple] = []

#: What each fault must produce at its step: the allowed outcomes per dtype.
EXPECTED = {
    "inf_grad": {"*": {"nonfinite_grad"}},
    "nan_grad": {"*": {"nonfinite_grad"}},
    "nan_loss": {"*": {"nonfinite_loss"}},
    "nan_input": {"*": {"nonfinite_loss"}},
    # finite spikes are clipped; in fp16 the scaled backward may overflow first
    "loss_spike": {"fp16": {"clipped", "nonfinite_grad"}, "*": {"clipped"}},
    "overflow": {"fp16": {"nonfinite_loss", "nonfinite_grad"}, "*": {"clipped"}},
}


def _run(dtype: str, accumulation: int, fault: str | None):
    cfg = compose_cfg(
        "+experiment=train",
        *TINY,
        f"amp.dtype={dtype}",
        f"accumulation_steps={accumulation}",
        "data.batch_size=8",
        "amp.init_scale=1024",
        "optim.lr=3e-3",
        "clip.max_norm=1.0",
    )
    task = build_task(cfg.model, cfg.data, seed=0)
    faults = FaultInjector(FaultsConfig(**({fault: [FAULT_STEP]} if fault else {})), task.model, task.loss_fn)
    state = build_state(cfg, task.model, faults.loss_fn, total_steps=STEPS)
    logs = [
        state.step(*(lambda b: (b.inputs, b.targets))(faults.batch(i, next(task.train_batches))))
        for i in range(1, STEPS + 1)
    ]
    return state, logs, faults


#: The full matrix is end to end (slow); one case per fault family stays in the fast subset.
FAST_CASES = {("nan_grad", "bf16", 1), ("nan_loss", "fp32", 1)}
CASES = [
    pytest.param(f, d, a, marks=() if (f, d, a) in FAST_CASES else pytest.mark.slow, id=f"{f}-{d}-{a}")
    for f in FAULTS
    for d in ("fp16", "bf16", "fp32")
    for a in (1, 4)
]


@pytest.fixture(scope="module")
def controls():
    return {}


def control(controls, dtype: str, accumulation: int):
    """The fault-free run of the same config (made once per module, on first use)."""
    if (dtype, accumulation) not in controls:
        controls[(dtype, accumulation)] = _run(dtype, accumulation, None)[1]
    return controls[(dtype, accumulation)]


@pytest.mark.parametrize("fault,dtype,accumulation", CASES)
def test_fault_is_contained(fault, dtype, accumulation, controls):
    state, logs, faults = _run(dtype, accumulation, fault)
    hit = logs[FAULT_STEP - 1]
    outcome = hit.skip_reason if hit.skipped else ("clipped" if hit.clipped else "taken")
    allowed = EXPECTED[fault].get(dtype, EXPECTED[fault]["*"])
    control_logs = control(controls, dtype, accumulation)
    tail = lambda ls: sum(l.loss for l in ls[-3:]) / 3  # noqa: E731
    MATRIX.append(
        (
            fault,
            dtype,
            accumulation,
            outcome,
            hit.grad_l2_pre_clip,
            hit.scaler_scale,
            logs[FAULT_STEP].scaler_scale,
            tail(logs),
            tail(control_logs),
        )
    )
    assert (FAULT_STEP, fault) in faults.fired
    assert outcome in allowed, f"{fault}/{dtype}/acc{accumulation}: {outcome} not in {allowed}"
    assert non_finite_state(state) is None  # params and optimizer state finite
    others = [l for i, l in enumerate(logs) if i != FAULT_STEP - 1]
    if dtype != "fp16":  # fp16 may also skip while its scale settles
        assert not any(l.skipped for l in others)
    if hit.skipped and dtype == "fp16":
        assert logs[FAULT_STEP].scaler_scale == hit.scaler_scale / 2  # backed off
    assert all(math.isfinite(l.loss) for l in logs[FAULT_STEP:])  # training went on
    assert tail(logs) == pytest.approx(tail(control_logs), rel=0.10)  # and is back on the control's trend


@pytest.mark.slow
def test_print_matrix():
    """Shown in the CI log (pytest -rA / the terminal summary) as the fault table."""
    if not MATRIX:
        pytest.skip("matrix not run")
    lines = [
        f"{'fault':<11}{'dtype':<6}{'acc':>4}  {'outcome':<15}{'pre-clip':>11}{'scale':>8}{'next':>8}"
        f"{'loss':>8}{'control':>9}"
    ]
    for f, d, a, o, pre, s0, s1, lt, lc in MATRIX:
        lines.append(f"{f:<11}{d:<6}{a:>4}  {o:<15}{pre:>11.3g}{s0:>8g}{s1:>8g}{lt:>8.3f}{lc:>9.3f}")
    text = "\n".join(lines)
    print("\nfault matrix\n" + text)
    with open(__import__("os").environ.get("CLIPAMP_FAULT_TABLE", "/dev/null"), "w") as fh:
        fh.write(text + "\n")
