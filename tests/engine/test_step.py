"""AmpTrainState: order of operations, skips that leave no trace, accumulation, checkpoints."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine import AmpTrainState, LossScaler, SkipLog, SkipRateExceeded, StepLog
from clipamp_engine.monitors import SkipRateMonitor

DTYPES = ["fp16", "bf16", "fp32"]


class Tiny(torch.nn.Module):
    """Two layers; ``poison`` makes the next backward write ``poison`` into the first weight's grad
    (a device-side fill: no host sync)."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.a = torch.nn.Linear(6, hidden)
        self.b = torch.nn.Linear(hidden, 1)
        self.poison = None
        self.a.weight.register_hook(self._hook)

    def _hook(self, g):
        if self.poison is None:
            return g
        bad, self.poison = self.poison, None
        g = g.clone()
        g[0, 0] = bad
        return g

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _pair(seed=0, opt=torch.optim.AdamW, **opt_kw):
    torch.manual_seed(seed)
    m = Tiny()
    return m, opt(m.parameters(), lr=1e-2, **opt_kw)


def _batch(i, n=8):
    g = torch.Generator().manual_seed(i)
    return torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)


def _opt_state_equal(o1, o2):
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        for name in s1[k]:
            assert torch.equal(torch.as_tensor(s1[k][name]), torch.as_tensor(s2[k][name])), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_skipped_grad_step_leaves_state_exactly_as_control(dtype, bad):
    """torch's GradScaler property: a skip == not calling optimizer.step() at all."""
    model, opt = _pair()
    state = AmpTrainState(
        model,
        opt,
        F.mse_loss,
        dtype=dtype,
        max_norm=1.0,
        scaler=LossScaler("cpu", init_scale=2.0**8, enabled=dtype == "fp16"),
    )
    for i in range(3):
        assert not state.step(*_batch(i)).skipped
    control_model, control_opt = copy.deepcopy(model), copy.deepcopy(opt)
    scale_before = state.scaler.get_scale()
    model.poison = bad
    log = state.step(*_batch(99))
    assert isinstance(log, SkipLog) and log.skipped and log.skip_reason == "nonfinite_grad"
    assert not math.isfinite(log.grad_l2_pre_clip)
    for p, q in zip(model.parameters(), control_model.parameters()):
        assert torch.equal(p, q)
        assert p.grad is None  # zero_grad(set_to_none=True) on skips too
    _opt_state_equal(opt, control_opt)  # Adam's step count included
    if dtype == "fp16":
        assert state.scaler.get_scale() == scale_before * 0.5
    else:
        assert state.scaler.get_scale() == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_loss_skips_before_backward(dtype):
    model, opt = _pair()
    calls = []
    model.b.weight.register_hook(lambda g: calls.append(1))
    state = AmpTrainState(
        model, opt, F.mse_loss, dtype=dtype, scaler=LossScaler("cpu", init_scale=1024.0, enabled=dtype == "fp16")
    )
    state.step(*_batch(0))
    assert calls == [1]
    before = copy.deepcopy(model.state_dict())
    x, y = _batch(1)
    log = state.step(x, y * float("nan"))
    assert log.skip_reason == "nonfinite_loss" and math.isnan(log.loss)
    assert calls == [1]  # no backward ran
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    if dtype == "fp16":  # GradScaler.update() would refuse here: the scale backs off anyway
        assert state.scaler.get_scale() == 512.0
        assert state.scaler.state_dict()["_growth_tracker"] == 0
    assert not state.step(*_batch(2)).skipped  # and training goes on


def test_fp16_scale_grows_after_clean_interval_and_halves_on_overflow():
    model, opt = _pair()
    state = AmpTrainState(
        model, opt, F.mse_loss, dtype="fp16", scaler=LossScaler("cpu", init_scale=256.0, growth_interval=2)
    )
    scales = [state.step(*_batch(i)).scaler_scale for i in range(3)]
    assert scales == [256.0, 256.0, 512.0]  # the scale used by each step's backward
    model.poison = float("inf")
    assert state.step(*_batch(9)).skipped
    assert state.scaler.get_scale() == 256.0  # the 512 in use, halved by the overflow


def test_clip_applies_to_unscaled_grads():
    """Clipping after unscale_: the threshold sees the true norm, not norm × scale."""
    model, opt = _pair()
    ref = copy.deepcopy(model)
    x, y = _batch(0)
    F.mse_loss(ref(x), y).backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    state = AmpTrainState(
        model, opt, F.mse_loss, dtype="fp16", max_norm=1e-3, scaler=LossScaler("cpu", init_scale=2.0**12)
    )
    log = state.step(x, y)
    assert log.grad_l2_pre_clip == pytest.approx(float(true_norm), rel=5e-3)
    assert log.grad_l2_post_clip == pytest.approx(1e-3, rel=1e-4) and log.clipped
    assert log.scaler_scale == 2.0**12


def test_scheduler_steps_only_on_taken_steps():
    model, opt = _pair()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp32", scheduler=sched)
    lrs = []
    for i in range(4):
        model.poison = float("nan") if i == 1 else None
        lrs.append(state.step(*_batch(i)).lr)
    assert lrs == [1e-2, 5e-3, 5e-3, 2.5e-3]


def _sgd_step(k, loss_fn, x, y):
    model, opt = _pair(opt=torch.optim.SGD)
    state = AmpTrainState(model, opt, loss_fn, dtype="fp32", accumulation_steps=k, max_norm=1e9)
    log = state.step(x, y)
    return [p.detach().clone() for p in model.parameters()], log


def test_accumulated_mean_loss_equals_full_batch():
    x, y = _batch(0, n=10)  # 10 samples in 4 micro-batches: 3, 3, 2, 2
    full, log1 = _sgd_step(1, F.mse_loss, x, y)
    acc, log4 = _sgd_step(4, F.mse_loss, x, y)
    for a, b in zip(full, acc):
        assert torch.allclose(a, b, atol=1e-6)
    assert log4.loss == pytest.approx(log1.loss, rel=1e-5)
    assert log4.grad_l2_pre_clip == pytest.approx(log1.grad_l2_pre_clip, rel=1e-5)


def _masked_sum_loss(out, y):
    """(loss_sum, token_count): rows with y == 0 are padding."""
    mask = y != 0
    return ((out - y) ** 2 * mask).sum(), mask.sum()


def test_accumulated_token_loss_is_token_mean_of_whole_batch():
    x, y = _batch(0, n=8)
    y[:3] = 0.0  # first micro-batch (of 2) is mostly padding: uneven token counts
    full, log1 = _sgd_step(1, _masked_sum_loss, x, y)
    acc, log2 = _sgd_step(2, _masked_sum_loss, x, y)
    for a, b in zip(full, acc):
        assert torch.allclose(a, b, atol=1e-6)
    assert log1.token_count == log2.token_count == 5
    assert log2.loss == pytest.approx(log1.loss, rel=1e-5)
    # and this differs from the mean of micro-batch means
    (o1, o2) = [_masked_sum_loss(_pair()[0](xs), ys) for xs, ys in zip(x.chunk(2), y.chunk(2))]
    assert log1.loss != pytest.approx(float((o1[0] / o1[1] + o2[0] / o2[1]).detach() / 2), rel=1e-3)


def test_device_type_must_match_model():
    model, opt = _pair()
    with pytest.raises(ValueError, match="device_type='cuda' disagrees.*'cpu'"):
        AmpTrainState(model, opt, F.mse_loss, device_type="cuda")


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(dtype="fp8"), "dtype='fp8' is not one of bf16, fp16, fp32"),
        (dict(dtype="bfloat16"), "dtype='bfloat16' is not one of bf16, fp16, fp32: pass dtype='bf16'"),  # nanoGPT's
        (dict(dtype=torch.float16), "dtype=torch.float16 is not one of bf16, fp16, fp32: pass dtype='fp16'"),
        (dict(max_norm=0.0), "max_norm=0.0 must be > 0"),
        (dict(accumulation_steps=0), "accumulation_steps=0 must be an integer >= 1"),
    ],
)
def test_bad_arguments_name_value_and_choices(kw, msg):
    model, opt = _pair()
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        AmpTrainState(model, opt, F.mse_loss, **kw)


def test_fail_fast_raises_with_the_record():
    model, opt = _pair()
    state = AmpTrainState(
        model, opt, F.mse_loss, dtype="fp32", skip_monitor=SkipRateMonitor(fail_window=4, fail_above=0.5)
    )
    x, y = _batch(0)
    for _ in range(3):
        state.step(x, y * float("inf"))  # window not yet full
    with pytest.raises(SkipRateExceeded, match="skip rate 100.0% over the last 4 steps") as e:
        state.step(x, y * float("inf"))
    assert e.value.record.step == 4 and e.value.record.skipped


def test_checkpoint_resume_is_bitwise_identical():
    def run(split):
        model, opt = _pair()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        st = AmpTrainState(
            model,
            opt,
            F.mse_loss,
            dtype="fp16",
            scheduler=sched,
            scaler=LossScaler("cpu", init_scale=64.0, growth_interval=2),
        )
        logs = [st.step(*_batch(i)) for i in range(split)]
        if split < 6:
            saved = copy.deepcopy(st.state_dict())
            model, opt = _pair(seed=123)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            st = AmpTrainState(
                model, opt, F.mse_loss, dtype="fp16", scheduler=sched, scaler=LossScaler("cpu", init_scale=1.0)
            )
            st.load_state_dict(saved)
        logs += [st.step(*_batch(i)) for i in range(split, 6)]
        return model, logs

    m_full, logs_full = run(6)
    m_res, logs_res = run(3)
    for p, q in zip(m_full.parameters(), m_res.parameters()):
        assert torch.equal(p, q)
    assert [l.row() for l in logs_full] == [l.row() for l in logs_res]


def test_a_compiled_models_checkpoint_loads_into_the_plain_model():
    """``torch.compile``'s wrapper adds ``_orig_mod.`` to its state dict's keys: the state's ``model`` entry
    is the plain module's, so a checkpoint of a compiled run resumes an uncompiled one (and the reverse)."""
    model, opt = _pair()
    compiled = torch.compile(model, backend="eager")
    st = AmpTrainState(compiled, opt, F.mse_loss, dtype="fp32")
    for i in range(3):
        st.step(*_batch(i))
    saved = copy.deepcopy(st.state_dict())
    assert list(saved["model"]) == list(model.state_dict())
    plain, plain_opt = _pair(seed=5)
    st2 = AmpTrainState(plain, plain_opt, F.mse_loss, dtype="fp32")
    st2.load_state_dict(saved)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    assert st.step(*_batch(3)) == st2.step(*_batch(3))


def test_load_without_model_and_optimizer_restores_the_rest_only():
    """A sharded checkpoint restores model and optimizer itself: the engine leaves them alone."""
    model, opt = _pair()
    st = AmpTrainState(model, opt, F.mse_loss, dtype="fp16", scaler=LossScaler("cpu", init_scale=64.0))
    for i in range(3):
        st.step(*_batch(i))
    saved = {k: v for k, v in copy.deepcopy(st.state_dict()).items() if k not in ("model", "optimizer")}
    fresh, fresh_opt = _pair(seed=5)
    before = [p.detach().clone() for p in fresh.parameters()]
    st2 = AmpTrainState(fresh, fresh_opt, F.mse_loss, dtype="fp16", scaler=LossScaler("cpu", init_scale=1.0))
    st2.load_state_dict(saved)
    assert st2.step_count == 3 and st2.scaler.get_scale() == st.scaler.get_scale()
    assert all(torch.equal(p, q) for p, q in zip(before, fresh.parameters())) and not fresh_opt.state


def test_records_are_steplogs_with_contract_fields():
    model, opt = _pair()
    log = AmpTrainState(model, opt, F.mse_loss).step(*_batch(0))
    assert type(log) is StepLog
    row = log.row()
    assert list(row)[:8] == [
        "step",
        "lr",
        "grad_l2_pre_clip",
        "grad_l2_post_clip",
        "loss",
        "skipped",
        "skip_reason",
        "scaler_scale",
    ]
    assert row["step"] == 1 and row["skipped"] is False and row["skip_reason"] == ""
