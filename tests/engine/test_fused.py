"""The fused path (unscale + clip inside a fused optimizer, deferred records) equals the default path.

With the ``multiply`` recipe (``clipamp_engine.fused.FACTOR_RECIPES``) it is the default path's
arithmetic, so records, parameters and optimizer state are equal bit for bit. With ``grad_scale``
the kernel divides by ``1/f`` where the default path multiplies by ``f``: the last bit differs on
some elements (about 6.5% of fp32 values for a clip coefficient of 0.135 at a loss scale of 2^16),
and the runs below stay within the bounds measured on them: records 1.2e-7 relative, parameters
5e-6 relative and 3e-8 absolute (asserted with margin: 1e-6, 1e-5, 1e-7).
"""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine import AmpTrainState, HysteresisScaler, LossScaler, SkipRateExceeded, make_clip_policy
from clipamp_engine.clip import GlobalCoefficientClip
from clipamp_engine.fused import DEFAULT_FACTOR_RECIPE, FACTOR_RECIPES, factor_recipe
from clipamp_engine.monitors import SkipRateMonitor

from .test_step import Tiny, _batch

FLOATS = ("lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss", "scaler_scale")


def _setup(
    dtype,
    fused,
    opt_name="adamw",
    accumulation=1,
    log_every=None,
    schedule=True,
    loss_fn=F.mse_loss,
    scaler_cls=LossScaler,
    clip=None,
    recipe=None,
    param_dtype=torch.float32,
):
    torch.manual_seed(0)
    model = Tiny().to(param_dtype)
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[opt_name]
    kw = {} if opt_name == "sgd" else {"weight_decay": 0.1}  # SGD with momentum keeps the default path
    opt = cls(model.parameters(), lr=1e-2, fused=True, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4)) if schedule else None
    state = AmpTrainState(
        model,
        opt,
        loss_fn,
        dtype=dtype,
        max_norm=0.5,
        clip=clip() if clip is not None else None,
        scheduler=sched,
        scaler=scaler_cls("cpu", init_scale=2.0**10, growth_interval=3, enabled=dtype == "fp16"),
        accumulation_steps=accumulation,
        fused=fused,
        log_every=log_every,
    )
    if recipe is not None and state.pipeline == "fused":
        state.fused_recipe = recipe  # instead of the device's choice
    return model, opt, sched, state


def _script(i, model):
    """Batch ``i`` of a run with injected faults: inf and NaN gradients, a NaN loss, spikes."""
    x, y = _batch(i)
    if i == 3:
        model.poison = float("inf")
    if i == 6:
        y = y * float("nan")  # NaN loss
    if i in (5, 9):
        x, y = x * 300, y * 300  # spike: clipped hard (fp16: also an overflow at a high scale)
    if i == 11:
        model.poison = float("nan")
    return x, y


def _run(dtype, fused, steps=14, deferred=False, **kw):
    model, opt, sched, state = _setup(dtype, fused, log_every=4 if deferred else None, **kw)
    records, params_before = [], []
    for i in range(steps):
        params_before.append([p.detach().clone() for p in model.parameters()])
        batch = _script(i, model)
        records += state.step_deferred(*batch) if deferred else [state.step(*batch)]
    records += state.flush()
    return model, opt, sched, state, records, params_before


def _same_record(a, b, rel):
    assert (a.step, a.skipped, a.skip_reason, a.clipped, a.token_count, a.max_norm) == (
        b.step,
        b.skipped,
        b.skip_reason,
        b.clipped,
        b.token_count,
        b.max_norm,
    )
    for name in FLOATS:
        x, y = getattr(a, name), getattr(b, name)
        assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=rel), (a.step, name, x, y)


def _bit_same_record(a, b):
    """Every field of two records equal bit for bit (NaN where NaN), the ``pipeline`` aside."""
    assert type(a) is type(b), (a.step, type(a), type(b))
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name != "pipeline" and not (isinstance(x, float) and math.isnan(x) and math.isnan(y)):
            assert (x, type(x)) == (y, type(y)), (a.step, f.name, x, y)


def _assert_fused_equals_default(st_f, rec_f, rec_d, m_f, m_d, o_f=None, o_d=None):
    """Bit for bit with the ``multiply`` recipe; within the measured bounds with ``grad_scale``."""
    assert st_f.pipeline == "fused" and st_f.fused_recipe in ("multiply", "grad_scale")
    assert {r.pipeline for r in rec_f} == {"fused"} and {r.pipeline for r in rec_d} == {"default"}
    states = [] if o_f is None else list(zip(o_f.state.values(), o_d.state.values(), strict=True))
    if st_f.fused_recipe == "multiply":
        for a, b in zip(rec_f, rec_d, strict=True):
            _bit_same_record(a, b)
        assert all(torch.equal(p, q) for p, q in zip(m_f.parameters(), m_d.parameters(), strict=True))
        assert all(torch.equal(sf[k], sd[k]) for sf, sd in states for k in sd)
        return
    for a, b in zip(rec_f, rec_d, strict=True):
        _same_record(a, b, rel=1e-6)
    for p, q in zip(m_f.parameters(), m_d.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    for sf, sd in states:
        for name in sd:
            torch.testing.assert_close(sf[name], sd[name], rtol=1e-5, atol=1e-7)


RECIPES = ["multiply", "grad_scale"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_fused_path_equals_default_path(dtype, opt_name, recipe):
    m_f, o_f, s_f, st_f, rec_f, before_f = _run(dtype, None, opt_name=opt_name, recipe=recipe)
    m_d, o_d, s_d, st_d, rec_d, before_d = _run(dtype, False, opt_name=opt_name)
    assert st_f.pipeline == "fused" and st_d.pipeline == "default" and st_f.fused_recipe == recipe
    reasons = [r.skip_reason for r in rec_d if r.skipped]
    assert {"nonfinite_grad", "nonfinite_loss"} <= set(reasons) and any(r.clipped for r in rec_d)
    _assert_fused_equals_default(st_f, rec_f, rec_d, m_f, m_d, o_f, o_d)
    assert s_f.last_epoch == s_d.last_epoch == sum(not r.skipped for r in rec_d)  # schedule: taken steps only
    assert st_f.scaler.get_scale() == st_d.scaler.get_scale()
    # a skipped step leaves the parameters bit-equal to what they were before it
    params_after = before_f[1:] + [[p.detach() for p in m_f.parameters()]]
    for r, pre, post in zip(rec_f, before_f, params_after):
        if r.skipped:
            assert all(torch.equal(a, b) for a, b in zip(pre, post)), r.step


def _staged():
    return make_clip_policy("staged", stages=[[0, 2.0], [5, 0.5], [9, 0.05]])


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_staged_clip_takes_the_fused_path_and_equals_default(dtype, recipe):
    """One global coefficient with a host-known τ per step: the policy says so, the fused path runs it."""
    m_f, o_f, _, st_f, rec_f, _ = _run(dtype, None, clip=_staged, recipe=recipe)
    m_d, o_d, _, st_d, rec_d, _ = _run(dtype, False, clip=_staged)
    assert st_f.pipeline == "fused" and st_d.pipeline == "default"
    assert [r.max_norm for r in rec_d] == [2.0] * 4 + [0.5] * 4 + [0.05] * 6  # every stage ran
    assert any(r.clipped for r in rec_d[4:8]) and all(r.clipped for r in rec_d[8:] if not r.skipped)
    _assert_fused_equals_default(st_f, rec_f, rec_d, m_f, m_d, o_f, o_d)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_one_stage_staged_clip_is_norm_clip_bit_for_bit_on_the_fused_path(dtype):
    m_s, _, _, _, rec_s, _ = _run(dtype, None, clip=lambda: make_clip_policy("staged", stages=[[0, 0.5]]))
    m_n, _, _, _, rec_n, _ = _run(dtype, None)  # norm at max_norm=0.5
    for a, b in zip(rec_s, rec_n, strict=True):
        _same_record(a, b, rel=0)
    assert all(torch.equal(p, q) for p, q in zip(m_s.parameters(), m_n.parameters()))


class HalfClip(GlobalCoefficientClip):
    """A user's policy: every gradient halved. It declares one coefficient, so it runs fused."""

    mode = "half"

    def coefficient(self, pre, step):
        return torch.full_like(pre, 0.5)


def test_a_users_single_coefficient_policy_takes_the_fused_path_and_equals_default():
    m_f, _, _, st_f, rec_f, _ = _run("bf16", None, clip=HalfClip)
    m_d, _, _, st_d, rec_d, _ = _run("bf16", False, clip=HalfClip)
    assert st_f.pipeline == "fused" and st_d.pipeline == "default"
    assert all(r.grad_l2_post_clip == pytest.approx(r.grad_l2_pre_clip / 2) for r in rec_d if not r.skipped)
    _assert_fused_equals_default(st_f, rec_f, rec_d, m_f, m_d)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_hysteresis_scaler_fused_equals_default(dtype, recipe):
    """The device-side hysteresis rule on the fused path gives the default path's scales and skips."""
    m_f, _, s_f, st_f, rec_f, _ = _run(dtype, None, scaler_cls=HysteresisScaler, recipe=recipe)
    m_d, _, s_d, st_d, rec_d, _ = _run(dtype, False, scaler_cls=HysteresisScaler)
    assert st_f.pipeline == "fused" and st_d.pipeline == "default"
    _assert_fused_equals_default(st_f, rec_f, rec_d, m_f, m_d)
    assert [r.scaler_scale for r in rec_f] == [r.scaler_scale for r in rec_d]
    assert st_f.scaler.state_dict() == st_d.scaler.state_dict()
    if dtype == "fp16":
        assert st_f.scaler.overflows > 0 and len({r.scaler_scale for r in rec_f}) > 1


def _calibrated_run(fused, recipe=None, param_dtype=torch.float32):
    torch.manual_seed(0)
    model = Tiny().to(param_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    clip = make_clip_policy("calibrated", window=5, total_steps=14)
    state = AmpTrainState(model, opt, F.mse_loss, dtype="bf16", clip=clip, fused=fused)
    if recipe is not None:
        state.fused_recipe = recipe
    recs = []
    for i in range(14):
        recs += state.step_deferred(*_script(i, model))
    recs += state.flush()
    return state, recs, model, opt


@pytest.mark.parametrize("recipe", RECIPES)
def test_calibrated_clip_fused_equals_default(recipe):
    """A calibration window closes on observed records; τ applies from the next step on both paths."""
    st_f, rec_f, m_f, o_f = _calibrated_run(None, recipe)
    st_d, rec_d, m_d, o_d = _calibrated_run(False)
    assert st_f.pipeline == "fused" and st_d.pipeline == "default"
    assert rec_d[-1].max_norm == st_d.clip.tau and any(r.clipped for r in rec_d[5:])
    if recipe == "multiply":
        assert st_f.clip.tau == st_d.clip.tau
    assert st_f.clip.tau == pytest.approx(st_d.clip.tau, rel=1e-6)
    _assert_fused_equals_default(st_f, rec_f, rec_d, m_f, m_d, o_f, o_d)


@pytest.mark.parametrize("clip", [None, _staged, "calibrated"])
def test_bf16_parameters_run_the_multiply_recipe_on_cpu_and_equal_default_bit_for_bit(clip):
    """bf16 parameters and gradients: the CPU's fastest recipe is the default path's arithmetic."""
    if clip == "calibrated":
        (st_f, rec_f, m_f, o_f), (st_d, rec_d, m_d, o_d) = (
            _calibrated_run(fused, param_dtype=torch.bfloat16) for fused in (None, False)
        )
        assert st_f.clip.tau == st_d.clip.tau and rec_d[-1].max_norm == st_d.clip.tau
    else:
        m_f, o_f, _, st_f, rec_f, _ = _run("bf16", None, clip=clip, param_dtype=torch.bfloat16)
        m_d, o_d, _, st_d, rec_d, _ = _run("bf16", False, clip=clip, param_dtype=torch.bfloat16)
    assert {p.dtype for p in m_f.parameters()} == {torch.bfloat16}
    assert st_f.fused_recipe == "multiply" and any(r.clipped for r in rec_d)
    assert {"nonfinite_grad", "nonfinite_loss"} <= {r.skip_reason for r in rec_d}
    _assert_fused_equals_default(st_f, rec_f, rec_d, m_f, m_d, o_f, o_d)


@pytest.mark.parametrize("accumulation", [2, 3])
def test_multiply_recipe_records_equal_default_bit_for_bit_with_accumulation(accumulation):
    """Equal and unequal micro-batches: the record's loss is summed wide on both paths, so every field of
    every record is the default path's (the fused path summed ``loss / k`` in fp32 before)."""
    m_f, o_f, _, st_f, rec_f, _ = _run("bf16", None, accumulation=accumulation, param_dtype=torch.bfloat16)
    m_d, o_d, _, st_d, rec_d, _ = _run("bf16", False, accumulation=accumulation, param_dtype=torch.bfloat16)
    assert st_f.fused_recipe == "multiply" and any(r.clipped for r in rec_d)
    _assert_fused_equals_default(st_f, rec_f, rec_d, m_f, m_d, o_f, o_d)


@pytest.mark.parametrize("recipe", RECIPES)
def test_calibrated_tau_applies_from_the_same_step_with_deferred_records(recipe):
    """Records flushed every 8 steps, a window closing at step 9 (not a flush step): the policy asks
    for a flush there, so τ clips step 10 as on the default path — same records, same parameters."""
    runs = []
    for fused, log_every in ((True, 8), (False, None)):
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        clip = make_clip_policy("calibrated", window=5, start=4, quantile=0.5, total_steps=20)
        state = AmpTrainState(model, opt, F.mse_loss, dtype="fp32", clip=clip, fused=fused, log_every=log_every)
        if fused:
            state.fused_recipe = recipe
        flushed_at, recs = [], []
        for i in range(20):
            out = state.step_deferred(*_script(i, model))
            flushed_at += [i + 1] if out else []
            recs += out
        recs += state.flush()
        runs.append((state, flushed_at, recs, model, opt))
    (st_f, at_f, rec_f, m_f, o_f), (_, _, rec_d, m_d, o_d) = runs
    assert at_f == [8, 9, 17]  # every 8 steps, and at the window's last step
    assert [r.max_norm is not None for r in rec_d].index(True) == 9 and rec_d[9].clipped  # step 10 clips at τ
    _assert_fused_equals_default(st_f, rec_f, rec_d, m_f, m_d, o_f, o_d)


def test_deferred_records_equal_per_step_records():
    """``step_deferred`` + ``flush`` every 4 steps: the same records, bit for bit, just later."""
    *_, rec_now, _ = _run("fp16", None)
    m, _, sched, state, rec_later, _ = _run("fp16", None, deferred=True)
    for a, b in zip(rec_now, rec_later, strict=True):
        _same_record(a, b, rel=0)
    assert sched.last_epoch == sum(not r.skipped for r in rec_later)


def test_token_mean_accumulation_matches_default_path():
    def token_loss(out, y):
        return F.mse_loss(out.float(), y, reduction="sum"), torch.tensor(y.numel())

    runs = [_run("bf16", fused, steps=6, accumulation=2, loss_fn=token_loss) for fused in (None, False)]
    for a, b in zip(runs[0][4], runs[1][4], strict=True):
        _same_record(a, b, rel=1e-5)
    for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_factor_recipe_is_chosen_per_device_and_dtype():
    fp32, bf16 = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)
    assert factor_recipe([fp32]) == FACTOR_RECIPES[("cpu", torch.float32)]
    assert factor_recipe([bf16]) == FACTOR_RECIPES[("cpu", torch.bfloat16)] == "multiply"
    assert factor_recipe([fp32, bf16]) == "multiply"  # one grad_scale per call: the multiply serves both
    assert factor_recipe([torch.empty(1, device="meta")]) == DEFAULT_FACTOR_RECIPE == "grad_scale"


def test_an_unknown_fused_recipe_is_refused_with_the_choices():
    model, opt, sched, state = _setup("fp32", None, recipe="fold")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"^fused recipe 'fold' is not one of grad_scale, multiply$"):
        state.step(*_batch(0))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_path_is_chosen_automatically():
    torch.manual_seed(0)
    model = Tiny()
    foreach = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert AmpTrainState(model, foreach, F.mse_loss).pipeline == "default"
    with pytest.raises(ValueError, match="fused=True"):
        AmpTrainState(model, foreach, F.mse_loss, fused=True)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    assert AmpTrainState(model, fused, F.mse_loss).pipeline == "fused"
    agc = make_clip_policy("agc", named_params=model)
    assert AmpTrainState(model, fused, F.mse_loss, clip=agc).pipeline == "default"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_sgd_with_momentum_keeps_the_default_path_and_a_skipped_first_step_changes_nothing(dtype):
    """torch's fused SGD would allocate its momentum buffers uninitialised on a skipped first step; the
    default path never steps on a skip, so the run equals one that never saw the bad batch."""
    runs = []
    for first_bad in (True, False):
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
        state = AmpTrainState(model, opt, F.mse_loss, dtype=dtype, scaler=LossScaler("cpu", enabled=dtype == "fp16"))
        assert state.pipeline == "default"
        if first_bad:
            x, y = _batch(0)
            assert state.step(torch.full_like(x, math.nan), y).skip_reason == "nonfinite_loss"
            assert opt.state == {} or all(s.get("momentum_buffer") is None for s in opt.state.values())
        for i in range(1, 4):
            assert not state.step(*_batch(i)).skipped
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    with pytest.raises(ValueError, match="SGD with momentum: torch's fused SGD allocates its momentum buffers"):
        AmpTrainState(model, opt, F.mse_loss, fused=True)
    plain = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    assert AmpTrainState(model, plain, F.mse_loss).pipeline == "fused"  # without momentum it stays fused


SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


def _host_reads_per_step(monkeypatch, state, model, steps=10):
    """Per step of ``state.step_deferred``: (records it flushed, the tensor→host reads it made), and the records."""
    calls = []
    for name in SYNCS:
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _o=orig, _n=name, **k: (calls.append(_n), _o(self, *a, **k))[1]
        )
    per_step, records = [], []
    for i in range(steps):
        out = state.step_deferred(*_script(i, model))
        per_step.append((len(out), list(calls)))
        records += out
        calls.clear()
    monkeypatch.undo()
    return per_step, records


@pytest.mark.parametrize("recipe", RECIPES)
def test_no_host_sync_between_flushes(monkeypatch, recipe):
    """By construction: no Python-level tensor→host read runs between two flushes."""
    model, opt, sched, state = _setup("fp16", None, log_every=5, recipe=recipe)
    assert state.fused_recipe == recipe
    per_step, records = _host_reads_per_step(monkeypatch, state, model)
    assert [n for n, _ in per_step] == [0, 0, 0, 0, 5] * 2
    assert [c for n, c in per_step if n == 0] == [[]] * 8  # no sync at all between flushes
    assert [c for n, c in per_step if n == 5] == [["tolist"]] * 2  # one transfer per flush
    assert {r.skip_reason for r in records} == {"", "nonfinite_grad", "nonfinite_loss"}
    assert sched.last_epoch == sum(not r.skipped for r in records)  # the schedule saw taken steps only


def test_hysteresis_scaler_has_no_host_sync_between_flushes(monkeypatch):
    """fp16 with the device-side hysteresis rule: nothing reaches the host between flushes; a flush
    is the records' transfer and the scaler's counters (its floor warning)."""
    model, opt, sched, state = _setup("fp16", None, log_every=5, scaler_cls=HysteresisScaler)
    per_step, records = _host_reads_per_step(monkeypatch, state, model)
    assert [n for n, _ in per_step] == [0, 0, 0, 0, 5] * 2
    assert [c for n, c in per_step if n == 0] == [[]] * 8
    assert [c for n, c in per_step if n == 5] == [["tolist", "tolist"]] * 2
    assert {r.skip_reason for r in records} == {"", "nonfinite_grad", "nonfinite_loss"}
    assert state.scaler.overflows == sum(r.skipped for r in records)  # the counters were kept on the device


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scaler_cls", [LossScaler, HysteresisScaler])
def test_no_cuda_sync_between_flushes(scaler_cls):
    torch.manual_seed(0)
    model = Tiny().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    scaler = scaler_cls("cuda")
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp16", scheduler=sched, scaler=scaler, log_every=4)
    batches = [tuple(t.cuda() for t in _batch(i)) for i in range(8)]
    state.step_deferred(*batches[0])  # warm-up (lazy state, scaler init)
    state.flush()
    for i in range(1, 4):
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert state.step_deferred(*batches[i]) == []
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len(state.step_deferred(*batches[4])) == 4


def test_skip_rate_alarm_at_flush_carries_every_record():
    model, opt, sched, state = _setup("fp32", None, log_every=4)
    state.skip_monitor = SkipRateMonitor(window=4, warn_above=1.0, fail_window=4, fail_above=0.2)
    for i in range(3):
        assert state.step_deferred(*_script(i + 10, model)) == []
    with pytest.raises(SkipRateExceeded) as err:
        state.step_deferred(*_script(3, model))
    assert [r.step for r in err.value.records] == [1, 2, 3, 4] and err.value.record.step == 4


def test_checkpoint_needs_a_flush_and_resumes_the_device_schedule():
    model, opt, sched, state = _setup("fp32", None, log_every=3)
    for i in range(4):
        state.step_deferred(*_batch(i))
    with pytest.raises(RuntimeError, match="flush"):
        state.state_dict()
    state.flush()
    ckpt = copy.deepcopy(state.state_dict())
    ref = [state.step(*_batch(i)) for i in range(4, 8)]
    model2, opt2, sched2, state2 = _setup("fp32", None, log_every=3)
    state2.load_state_dict(ckpt)
    resumed = [state2.step(*_batch(i)) for i in range(4, 8)]
    for a, b in zip(resumed, ref, strict=True):
        _same_record(a, b, rel=0)


def test_log_every_set_after_construction_runs_the_same_schedule():
    """``state.log_every = 6`` on a state built with the CPU default (1) crashed at the third step: the
    device LR window still covered one step ("INDICES element is out of DATA bounds")."""
    model, opt, sched, state = _setup("fp32", None, log_every=None)
    ref_model, _, _, ref = _setup("fp32", None, log_every=6)
    state.log_every = 6
    records = [r for i in range(14) for r in state.step_deferred(*_script(i, model))] + state.flush()
    expected = [r for i in range(14) for r in ref.step_deferred(*_script(i, ref_model))] + ref.flush()
    for a, b in zip(records, expected, strict=True):
        _same_record(a, b, rel=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    assert [r.lr for r in records] == [r.lr for r in expected] and sched.last_epoch == ref.scheduler.last_epoch
    state.step_deferred(*_batch(20))
    with pytest.raises(RuntimeError, match="1 records are pending: call flush"):
        state.log_every = 2
    with pytest.raises(ValueError, match="log_every=0 must be an integer >= 1"):
        state.log_every = 0


@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_step_at_a_stage_boundary_records_that_stages_tau(fused):
    """The skipped step's clip never ran; its record still names the τ of its own stage, on both paths."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    clip = make_clip_policy("staged", stages=[[0, 2.0], [3, 0.5]])
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp32", clip=clip, fused=fused)
    logs = []
    for i in range(1, 5):
        x, y = _batch(i)
        logs += [state.step(torch.full_like(x, math.nan) if i == 3 else x, y), *state.flush()]
    logs = [r for r in logs if r is not None]
    assert [(r.step, r.skipped, r.max_norm) for r in logs] == [
        (1, False, 2.0),
        (2, False, 2.0),
        (3, True, 0.5),
        (4, False, 0.5),
    ]


def _token_sum_loss(out, y):
    """A ``(loss_sum, token_count)`` loss: the count of one micro-batch is its element count."""
    return F.mse_loss(out, y, reduction="sum"), y.numel()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_nonfinite_loss_records_the_whole_batch_s_tokens_on_both_paths(dtype):
    """A NaN loss in the first of 2 micro-batches (step 7): the default path still counts the batch's
    other micro-batch, as the fused path does; the records agree as token-mean runs do (the fused
    path's loss is an fp32 device sum: 1e-5), and so do the parameters after it."""
    runs = [_run(dtype, fused, accumulation=2, loss_fn=_token_sum_loss) for fused in (None, False)]
    (m_f, _, _, st_f, rec_f, _), (m_d, _, _, st_d, rec_d, _) = runs
    assert st_f.pipeline == "fused" and st_d.pipeline == "default"
    skip = rec_d[6]
    assert skip.skip_reason == "nonfinite_loss" and math.isnan(skip.loss)
    assert skip.token_count == rec_d[5].token_count == _batch(6)[1].numel()  # before: half of it
    for a, b in zip(rec_f, rec_d, strict=True):
        _same_record(a, b, rel=1e-5)
    for p, q in zip(m_f.parameters(), m_d.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("total", [40, 60])
def test_an_auto_placed_window_shorter_than_log_every_adopts_tau_on_time(total):
    """``start="auto"`` decides the window's start from records, which the fused path sees at flushes
    (every 12 steps here); a 4-step window must still close on a flush, so τ clips from the step
    after it as on the default path: same records, same parameters."""
    runs = []
    for fused, log_every in ((True, 12), (False, None)):
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        clip = make_clip_policy("calibrated", window=4, start="auto", quantile=0.5, total_steps=total)
        state = AmpTrainState(model, opt, F.mse_loss, dtype="fp32", clip=clip, fused=fused, log_every=log_every)
        state.fused_recipe = "multiply"
        recs = []
        for i in range(total):
            recs += state.step_deferred(*_script(i, model))
        recs += state.flush()
        runs.append((state, recs, model, opt))
    (st_f, rec_f, m_f, o_f), (st_d, rec_d, m_d, o_d) = runs
    assert st_f.pipeline == "fused" and st_d.clip.placement is not None and st_d.clip.summaries
    end = st_d.clip.summaries[0].end_step
    assert rec_d[end].max_norm == st_d.clip.summaries[0].recommended_max_norm  # the step after the window
    assert [r.max_norm for r in rec_f] == [r.max_norm for r in rec_d]
    _assert_fused_equals_default(st_f, rec_f, rec_d, m_f, m_d, o_f, o_d)
