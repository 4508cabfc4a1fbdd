"""``AmpTrainState`` misuse is a ``ValueError`` naming the argument (not a silent no-op, a skip with a
wrong reason, or an error from deep inside torch)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine import AmpTrainState, HysteresisScaler, LossScaler, NoClip, make_clip_policy


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _batch(n: int = 8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)


def test_an_optimizer_over_another_models_parameters_is_refused():
    model, other = _model(0), _model(1)
    with pytest.raises(ValueError, match=r"none of them the model's: every step would update nothing"):
        AmpTrainState(model, torch.optim.SGD(other.parameters(), lr=0.1), F.mse_loss, dtype="fp32")


def test_an_optimizer_whose_step_needs_a_closure_is_refused_before_any_step():
    """LBFGS re-evaluates the loss inside ``step(closure)``: refused when the state is built, not with torch's
    ``missing 1 required positional argument: 'closure'`` after the first forward and backward."""
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as e:
        AmpTrainState(model, torch.optim.LBFGS(model.parameters(), lr=0.1), F.mse_loss, dtype="fp32")
    assert str(e.value).startswith("LBFGS.step() needs an argument (closure): it re-evaluates the loss")
    assert "use a first-order optimizer (SGD, AdamW, ...)" in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_optimizer_with_an_extra_parameter_is_accepted():
    model = _model()
    extra = torch.nn.Parameter(torch.ones(()))
    state = AmpTrainState(model, torch.optim.SGD([*model.parameters(), extra], lr=0.1), F.mse_loss, dtype="fp32")
    assert not state.step(*_batch()).skipped


def test_accumulation_larger_than_the_batch_is_a_value_error():
    model = _model()
    state = AmpTrainState(
        model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, dtype="fp32", accumulation_steps=8
    )
    with pytest.raises(ValueError, match=r"accumulation_steps=8 is larger than the batch \(4 samples\)"):
        state.step(*_batch(4))
    assert not state.step(*_batch(8)).skipped  # exactly one sample per micro-batch is fine


@pytest.mark.parametrize(
    "loss_fn,message",
    [
        (
            lambda out, y: F.mse_loss(out, y, reduction="none"),
            r"loss_fn returned a torch.float32 tensor of shape \(8, 1\), not a floating scalar",
        ),
        (lambda out, y: float(F.mse_loss(out, y)), r"loss_fn returned a float \(.*\), not a tensor"),
        (
            lambda out, y: (F.mse_loss(out, y, reduction="sum"), 0),
            r"loss_fn returned \(loss_sum, token_count\) with 0 tokens in the whole batch: the token count must be > 0",
        ),
        (
            lambda out, y: (F.mse_loss(out, y, reduction="sum"), -1),
            r"loss_fn returned \(loss_sum, -1\): the token count must be >= 0 in a micro-batch",
        ),
        (lambda out, y: (F.mse_loss(out, y), 8, 1), r"loss_fn returned a tuple of 3 items"),
    ],
    ids=["non-scalar", "float", "zero-tokens", "negative-tokens", "triple"],
)
@pytest.mark.parametrize("fused", [False, True])
def test_a_loss_of_the_wrong_form_is_named(loss_fn, message, fused):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True) if fused else torch.optim.SGD(model.parameters())
    state = AmpTrainState(model, opt, loss_fn, dtype="fp32", fused=fused)
    with pytest.raises(ValueError, match=message):
        state.step(*_batch())


@pytest.mark.parametrize("max_norm", [None, "1.0", math.nan, True])
def test_a_max_norm_that_is_no_number_is_named(max_norm):
    model = _model()
    with pytest.raises(ValueError, match=rf"max_norm={max_norm!r} must be a number > 0".replace("(", r"\(")):
        AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, dtype="fp32", max_norm=max_norm)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_norm=0.0), r"^max_norm=0.0 must be > 0; to train without clipping pass clip=NoClip\(\)"),
        (dict(clip="norm"), r"^clip='norm' is not a clip policy: pass make_clip_policy\('norm', ...\) or a policy"),
        (dict(clip_window=0), r"^clip_window=0 must be a number of steps >= 1"),
    ],
    ids=["max_norm 0 (nanoGPT's grad_clip=0.0: off)", "a mode name for clip", "clip_window 0"],
)
def test_a_setting_that_cannot_run_names_the_argument_and_the_fix(kwargs, message):
    """Each refusal names the argument the user passed and what to pass instead; the fix it names runs."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=message):
        AmpTrainState(model, opt, F.mse_loss, dtype="fp32", **kwargs)
    fixed = {"max_norm": dict(clip=NoClip()), "clip": dict(clip=make_clip_policy("norm", max_norm=1.0))}
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp32", **fixed.get(next(iter(kwargs)), dict(clip_window=1)))
    assert not state.step(*_batch()).skipped


def test_checked_steps_equal_an_unchecked_reference():
    """The checks change nothing: two steps equal plain torch (clip_grad_norm_ then SGD)."""
    model, ref = _model(), _model()
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, dtype="fp32", max_norm=0.5)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        x, y = _batch()
        state.step(x, y)
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _token_loss(count):
    """A ``(loss_sum, token_count)`` loss whose count is ``count(n)`` for a micro-batch of n rows."""
    return lambda out, y: (F.mse_loss(out, y, reduction="sum"), count(y.shape[0]))


@pytest.mark.parametrize("fused", [False, True])
def test_an_int_token_count_is_a_tensor_count(fused):
    """``(loss_sum, 8)`` and ``(loss_sum, torch.tensor(8))`` give the same run on either path."""
    runs = []
    for count in (int, torch.tensor):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
        state = AmpTrainState(model, opt, _token_loss(count), dtype="fp32", max_norm=0.5, accumulation_steps=2)
        logs = [state.step(*_batch()) for _ in range(3)] + state.flush()
        runs.append(([p.detach().clone() for p in model.parameters()], [r for r in logs if r is not None]))
    (params_int, logs_int), (params_t, logs_t) = runs
    assert all(torch.equal(a, b) for a, b in zip(params_int, params_t))
    assert [(r.grad_l2_pre_clip, r.loss, r.token_count) for r in logs_int] == [
        (r.grad_l2_pre_clip, r.loss, r.token_count) for r in logs_t
    ]
    assert logs_int[-1].token_count == 8


def test_a_zero_token_count_tensor_is_named_on_the_default_path_and_changes_nothing():
    model = _model()
    state = AmpTrainState(
        model, torch.optim.SGD(model.parameters(), lr=0.1), _token_loss(lambda n: torch.tensor(0)), dtype="fp32"
    )
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"with 0 tokens in the whole batch: the token count must be > 0"):
        state.step(*_batch())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())


def _weighted_loss(out, y):
    """A token-style loss: rows whose target is 0 are padding (no token, no loss)."""
    real = (y != 0).float()
    return (real * (out - y) ** 2).sum(), real.sum()


@pytest.mark.parametrize("fused", [False, True])
def test_a_micro_batch_without_tokens_is_fine_the_batch_is_the_token_mean(fused):
    """With accumulation, a micro-batch of padding only (0 tokens) contributes nothing: the step is the
    token mean over the whole batch, as one micro-batch computes it, on either path."""
    x, y = _batch(8)
    y[:4] = 0.0  # the first micro-batch (k=2) is all padding
    runs = []
    for k in (2, 1):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
        state = AmpTrainState(model, opt, _weighted_loss, dtype="fp32", max_norm=10.0, accumulation_steps=k)
        logs = [state.step(x, y), *state.flush()]
        log = next(r for r in logs if r is not None)
        runs.append((log, [p.detach().clone() for p in model.parameters()]))
    (log2, params2), (log1, params1) = runs
    assert not log2.skipped and log2.token_count == log1.token_count == 4
    assert log2.loss == pytest.approx(log1.loss, rel=1e-6)
    assert log2.grad_l2_pre_clip == pytest.approx(log1.grad_l2_pre_clip, rel=1e-5)
    for a, b in zip(params2, params1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_zero_token_count_tensor_on_the_fused_path_is_a_skipped_step():
    """No sync to check the count on: 0 tokens make the token mean 0/0, a non-finite loss, so the step
    is skipped with the parameters and the optimizer state untouched."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    state = AmpTrainState(model, opt, _token_loss(lambda n: torch.tensor(0)), dtype="fp32")
    before = [p.detach().clone() for p in model.parameters()]
    (log,) = [r for r in [state.step(*_batch()), *state.flush()] if r is not None]
    assert log.skipped and log.skip_reason == "nonfinite_loss"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    for s in opt.state.values():  # as a fresh AdamW's: no step counted, zero moments
        assert float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()


@pytest.mark.parametrize("fused", [False, True])
def test_a_token_count_past_fp32s_integers_is_recorded_exactly(fused):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    count = 2**24 + 1  # the first integer fp32 cannot hold
    state = AmpTrainState(model, opt, _token_loss(lambda n: torch.tensor(count)), dtype="fp32")
    (log,) = [r for r in [state.step(*_batch()), *state.flush()] if r is not None]
    assert log.token_count == count


@pytest.mark.parametrize("change", ["dtype", "no scheduler", "a scheduler", "another loop"])
def test_a_checkpoint_of_another_setup_is_refused_before_anything_loads(change):
    """An fp16 run's loss scale is not a bf16 run's; a schedule is not dropped or invented silently; a
    checkpoint of another loop (nanoGPT's keys) does not half-load."""

    def build(dtype="fp16", scheduled=True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0) if scheduled else None
        return model, AmpTrainState(model, opt, F.mse_loss, dtype=dtype, scheduler=sched)

    _, source = build(scheduled=change != "a scheduler")
    source.step(*_batch())
    saved = source.state_dict()
    if change == "another loop":
        saved = {
            "model": saved["model"],
            "optimizer": saved["optimizer"],
            "iter_num": 1,
            "scheduler": saved["scheduler"],
        }
    model, target = build(dtype="bf16" if change == "dtype" else "fp16", scheduled=change in ("dtype", "a scheduler"))
    before = [p.detach().clone() for p in model.parameters()]
    message = {
        "dtype": r"the checkpoint is of a dtype='fp16' run and this AmpTrainState has dtype='bf16'",
        "no scheduler": r"the checkpoint has a LR scheduler state and this AmpTrainState has no scheduler",
        "a scheduler": r"the checkpoint has no LR scheduler state and this AmpTrainState has a scheduler",
        "another loop": r"^the checkpoint has no scaler, clip, skip_monitor, clip_monitor, step_count entries: it was "
        r"not saved from AmpTrainState.state_dict\(\) \(nothing was loaded\); save state.state_dict\(\) in checkpoints",
    }[change]
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(saved)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and target.step_count == 0


def test_a_scheduler_that_steps_on_a_metric_is_refused_before_any_update():
    """``ReduceLROnPlateau.step(metrics)`` cannot be stepped by the engine; accepted, it raised after the
    optimizer had updated, lost the record and left an fp16 scaler unable to step again."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        ValueError,
        match=r"scheduler=ReduceLROnPlateau: its step\(\) needs an argument .* pass scheduler=None and call "
        r"ReduceLROnPlateau.step\(metric\) yourself",
    ):
        AmpTrainState(model, optimizer, F.mse_loss, dtype="fp16", scheduler=plateau)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert optimizer.state == {}


def test_a_scheduler_of_another_optimizer_is_refused():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"scheduler=StepLR schedules another optimizer \(SGD at 0x"):
        AmpTrainState(model, optimizer, F.mse_loss, dtype="fp32", scheduler=torch.optim.lr_scheduler.StepLR(other, 1))


@pytest.mark.parametrize("make", [lambda: LossScaler("cuda"), lambda: HysteresisScaler(hysteresis=2)])
def test_a_scaler_for_another_device_is_refused_not_silently_disabled(make):
    """torch disables a GradScaler whose device it cannot use (a warning at most): fp16 would train with
    no loss scaling while the records said scaler_scale 1.0."""
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "CUDA is not available. Disabling" on a CPU-only machine
        scaler = make()
    name = type(scaler).__name__
    with pytest.raises(
        ValueError, match=rf"scaler={name}\('cuda', \.\.\.\) is for another device .* {name}\('cpu', \.\.\.\)"
    ):
        AmpTrainState(model, torch.optim.AdamW(model.parameters()), F.mse_loss, dtype="fp16", scaler=scaler)
    state = AmpTrainState(
        model, torch.optim.AdamW(model.parameters()), F.mse_loss, dtype="fp16", scaler=HysteresisScaler("cpu")
    )
    assert state.step(*_batch()).scaler_scale == 2.0**16


def test_an_optimizer_holding_nothing_is_refused():
    """``SGD([{"params": []}])`` builds in torch; every step would have returned a record of ‖g‖ = 0."""
    with pytest.raises(ValueError, match=r"^the optimizer holds 0 parameter tensor\(s\), none of them the model's"):
        AmpTrainState(_model(), torch.optim.SGD([{"params": []}], lr=0.1), F.mse_loss, dtype="fp32")


@pytest.mark.parametrize(
    "args, message",
    [
        ("swapped", r"^model is a SGD, not a torch.nn.Module: call AmpTrainState\(model, optimizer, loss_fn\)"),
        ("not_an_optimizer", r"^optimizer is a Linear, not an optimizer \(param_groups and step\(\)\)"),
        ("dtype_as_loss_fn", r"^loss_fn='bf16' is not callable: pass a function of \(output, targets\).*dtype='bf16'"),
    ],
)
def test_arguments_of_the_wrong_kind_are_named_at_construction(args, message):
    """Swapped positional arguments, or a dtype passed where ``loss_fn`` goes: before, an ``AttributeError`` from
    ``model.parameters()`` or a ``TypeError: 'str' object is not callable`` at the first step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    call = {
        "swapped": (opt, model, F.mse_loss),
        "not_an_optimizer": (model, torch.nn.Linear(1, 1), F.mse_loss),
        "dtype_as_loss_fn": (model, opt, "bf16"),
    }[args]
    with pytest.raises(ValueError, match=message):
        AmpTrainState(*call)


@pytest.mark.parametrize("why", ["frozen", "detached"])
def test_a_loss_without_a_gradient_is_named_and_takes_no_step(why):
    """Every parameter frozen, or a loss cut from the graph: torch's "element 0 of tensors does not require
    grad" before; now one line that names both causes, and the step takes no step number."""
    model = _model()
    loss_fn = F.mse_loss if why == "frozen" else (lambda out, y: F.mse_loss(out, y).detach())
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, dtype="fp32")
    if why == "frozen":
        model.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"^the loss does not require grad, so it has no gradient to step on"):
        state.step(*_batch())
    assert state.step_count == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_trainable_parameters_the_optimizer_does_not_hold_are_named_in_a_warning():
    """A head-only fine-tune that left the body trainable: the engine norms what the optimizer updates, the
    loop ``clip_grad_norm_(model.parameters())`` would count the body's never-zeroed gradients too."""
    model = _model()
    with pytest.warns(UserWarning) as caught:
        AmpTrainState(model, torch.optim.SGD(model[2].parameters(), lr=0.1), F.mse_loss, dtype="fp32")
    assert len(caught) == 1 and str(caught[0].message).startswith(
        "2 of the model's parameter tensors require grad but the optimizer does not hold them (0.weight, 0.bias)"
    )
    assert caught[0].filename == __file__  # points at the caller's line
    model[0].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AmpTrainState(model, torch.optim.SGD(model[2].parameters(), lr=0.1), F.mse_loss, dtype="fp32")


@pytest.mark.parametrize(
    ("saved_mode", "resumed_mode", "message"),
    [
        (
            "calibrated",
            "norm",
            r"holds state calibrator, .*which this AmpTrainState's clip='norm' \(GlobalNormClip\) does not keep",
        ),
        (
            "norm",
            "calibrated",
            r"holds no state, which this AmpTrainState's clip='calibrated' \(CalibratedClip\) needs",
        ),
        ("zscore", "quantile", r"holds state mean, var, warmup_norms, which .*clip='quantile'"),
        ("dpsgd", "norm", r"holds state generator, which .*clip='norm'"),
    ],
)
def test_a_checkpoint_of_another_clip_mode_is_refused_before_anything_loads(saved_mode, resumed_mode, message):
    """Resuming with another clip policy dropped a calibrated window and its τ (or DP-SGD's noise stream)
    silently, or raised a bare ``KeyError`` from the policy after the model had been overwritten."""

    def build(mode):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, AmpTrainState(model, opt, F.mse_loss, dtype="fp32", clip=make_clip_policy(mode))

    _, source = build(saved_mode)
    source.step(*_batch())
    model, target = build(resumed_mode)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=message + r".*nothing was loaded\); build the AmpTrainState with the clip"):
        target.load_state_dict(source.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and target.step_count == 0
