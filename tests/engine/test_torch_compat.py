"""Each private torch symbol behind ``clipamp_engine._torch_compat`` exists and behaves as the engine assumes.

A failure here after a torch upgrade names the one compat function to adapt; torch stays pinned
(pyproject.toml) to the releases these tests pass on.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn

from clipamp_engine import _torch_compat as compat

PYPROJECT = Path(compat.__file__).resolve().parents[1] / "pyproject.toml"


def _param_and_opt(fused: bool = False):
    p = nn.Parameter(torch.ones(3))
    return p, torch.optim.AdamW([p], lr=0.1, fused=fused) if fused else torch.optim.SGD([p], lr=0.1)


def _scaled_iteration(scaler, p, opt, factor: float):
    scaler.scale((p * factor).sum()).backward()
    scaler.unscale_(opt)


def test_torch_is_a_release_the_pin_allows():
    """The pin in pyproject.toml is the range these tests were run on (torch 2.13)."""
    pin = next(d for d in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"] if d.startswith("torch"))
    assert Requirement(pin).specifier == SpecifierSet(">=2.13.0,<2.14")
    assert Version(torch.__version__.split("+")[0]) in Requirement(pin).specifier


def test_scale_tensors_are_none_until_scale_then_the_live_fp32_and_int32_tensors():
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    assert compat.scale_tensors(scaler) is None
    scaler.scale(torch.ones(()))
    scale, tracker = compat.scale_tensors(scaler)
    assert (scale.dtype, scale.shape, tracker.dtype, tracker.shape) == (torch.float32, (), torch.int32, ())
    assert float(scale) == scaler.get_scale() == 256.0
    scale.fill_(64.0)  # the tensor GradScaler itself reads: writing it changes the scale
    tracker.fill_(3)
    assert scaler.get_scale() == 64.0 and scaler.state_dict()["_growth_tracker"] == 3


def test_found_infs_are_what_unscale_recorded_and_reset_forgets_them():
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    p, opt = _param_and_opt()
    assert compat.found_infs(scaler) == []
    _scaled_iteration(scaler, p, opt, float("inf"))
    infs = compat.found_infs(scaler)
    assert len(infs) == 1 and float(infs[0].sum()) == 1.0
    compat.reset_inf_checks(scaler)
    assert compat.found_infs(scaler) == []
    with pytest.raises(AssertionError, match="No inf checks"):
        scaler.update()  # GradScaler.update reads the same per-optimizer state


@pytest.mark.parametrize("found", [0.0, 1.0])
def test_record_found_inf_is_an_inf_check_gradscaler_update_acts_on(found):
    """Recorded without unscale_, ``GradScaler.update`` backs off on 1 and counts a clean step on 0."""
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)
    p, opt = _param_and_opt()
    scaler.scale(torch.ones(()))
    compat.record_found_inf(scaler, opt, torch.tensor(found))
    assert [float(f) for f in compat.found_infs(scaler)] == [found]
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)  # the optimizer's stage is STEPPED, as after a real step
    scaler.update()
    assert scaler.get_scale() == (128.0 if found else 512.0)


def test_takes_grad_scale_is_true_for_fused_optimizers_only():
    p = nn.Parameter(torch.ones(2))
    assert compat.takes_grad_scale(torch.optim.AdamW([p], fused=True))
    assert compat.takes_grad_scale(torch.optim.SGD([p], lr=0.1, fused=True))
    assert not compat.takes_grad_scale(torch.optim.AdamW([p], foreach=True))
    assert not compat.takes_grad_scale(torch.optim.SGD([p], lr=0.1))


@pytest.mark.parametrize("found", [0.0, 1.0])
def test_fused_step_divides_by_grad_scale_and_skips_on_found_inf(found):
    """What ``fused_optimizer_step`` relies on: the kernel reads ``optimizer.grad_scale`` / ``found_inf``."""
    ref = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    fused = nn.Parameter(ref.detach().clone())
    ref.grad = torch.tensor([0.5, 0.25, -1.0])
    fused.grad = ref.grad * 4.0
    ref_opt = torch.optim.SGD([ref], lr=0.1, fused=True)
    opt = torch.optim.SGD([fused], lr=0.1, fused=True)
    ref_opt.step()
    opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.tensor(found)
    opt.step()
    want = torch.tensor([1.0, -2.0, 3.0]) if found else ref.detach()
    assert torch.equal(fused.detach(), want)


def test_fused_kernel_devices_list_cpu_and_cuda():
    devices = compat.fused_kernel_devices()
    assert {"cpu", "cuda"} <= set(devices) and all(isinstance(d, str) for d in devices)


def test_set_last_lr_is_what_get_last_lr_returns_and_survives_state_dict():
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    compat.set_last_lr(sched, [0.125])
    assert sched.get_last_lr() == [0.125]
    again = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    again.load_state_dict(sched.state_dict())
    assert again.get_last_lr() == [0.125]


def test_sparse_values_alias_a_coalesced_tensor_and_keep_it_coalesced():
    t = torch.sparse_coo_tensor([[0, 2, 2]], [1.0, 2.0, 3.0], (4,), check_invariants=True).coalesce()
    values = compat.sparse_values(t)
    values.mul_(2.0)
    assert t.is_coalesced() and torch.equal(t.to_dense(), torch.tensor([2.0, 0.0, 10.0, 0.0]))
    assert torch.equal(t.values(), values)


_DTENSOR_CHILD = """
import torch
from clipamp_engine import _torch_compat as compat
before = compat.dtensor_class()
import torch.distributed.tensor as dt
after = compat.dtensor_class()
print(before is None, after is dt.DTensor, callable(getattr(after, "full_tensor", None)))
"""


@pytest.mark.slow  # a fresh interpreter: whether DTensor was imported depends on what ran before
def test_dtensor_class_is_none_until_imported_then_the_class_with_full_tensor():
    out = subprocess.run([sys.executable, "-c", _DTENSOR_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True"]


def test_dtensor_class_is_the_imported_class():
    import torch.distributed.tensor as dt

    assert compat.dtensor_class() is dt.DTensor and callable(dt.DTensor.full_tensor)


def test_compiled_original_is_the_module_a_compile_wrapper_runs():
    """``torch.compile`` wraps a module in an ``OptimizedModule`` whose forward takes ``*args, **kwargs``;
    the engine reads the wrapped module's signature (how to pass targets) through this one function."""
    plain = torch.nn.Linear(2, 2)
    assert compat.compiled_original(plain) is None
    assert compat.compiled_original(torch.compile(plain)) is plain


_FSDP_CHILD = """
import os, sys, tempfile
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from clipamp_engine import _torch_compat as compat
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
x1, x2 = torch.randn(4, 3), torch.randn(4, 3)
for mp in (None, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
    torch.manual_seed(0)
    plain = nn.Linear(3, 2)
    torch.manual_seed(0)
    model = fully_shard(nn.Linear(3, 2), **({"mp_policy": mp} if mp else {}))
    assert compat.fsdp_unreduced_grads(model) == []
    model.set_requires_gradient_sync(False)
    model(x1).sum().backward()  # accumulated, not reduced: the sharded .grad is still None
    held = compat.fsdp_unreduced_grads(model)
    assert len(held) == 2 and all(p.grad is None for p in model.parameters()), held
    compat.fsdp_drop_unreduced_grads(model)
    assert compat.fsdp_unreduced_grads(model) == []
    model.set_requires_gradient_sync(True)
    model(x2).sum().backward()  # reduced: x2's gradient only, nothing of x1's
    (plain(x2.to(torch.bfloat16).float() if mp else x2)).sum().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-2 if mp else 1e-6, atol=1e-2 if mp else 1e-7)
print("ok")
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.slow  # a fresh interpreter with a one-rank process group
def test_fsdp_unreduced_grads_are_what_no_sync_accumulated_and_drop_forgets_them():
    """FSDP2 keeps micro-batches' gradients under ``set_requires_gradient_sync(False)`` in its own unsharded
    state (with a ``reduce_dtype``, an upcast accumulator): listed, dropped, and absent from the next reduction."""
    out = subprocess.run([sys.executable, "-c", _FSDP_CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok"]
