"""The engine's shape: a small top level, capabilities instead of type switches, torch internals in one place."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import clipamp_engine
from clipamp_engine import AmpTrainState, LossScaler

from .test_step import Tiny

ENGINE = Path(clipamp_engine.__file__).resolve().parent
COMPAT = ENGINE / "_torch_compat.py"
APP_LIBRARIES = {"sweep", "hydra", "omegaconf", "optuna", "mlflow"}
#: torch names the engine reaches only through ``_torch_compat`` (private attributes and functions).
PRIVATE_TORCH = {
    "_per_optimizer_states",
    "_scale",
    "_growth_tracker",
    "_init_scale",
    "_init_growth_tracker",
    "_check_scale_growth_tracker",
    "_refresh_per_optimizer_state",
    "_lazy_init_scale_growth_tracker",
    "_get_scale_async",
    "_get_fused_kernels_supported_devices",
    "_step_supports_amp_scaling",
    "_enabled",
    "_backoff_factor",
    "_growth_factor",
    "_growth_interval",
    "_last_lr",
    "_values",
    "_orig_mod",
    "OptState",
}


def _modules() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(ENGINE.rglob("*.py"))}


def test_top_level_is_small_and_every_name_imports():
    names = clipamp_engine.__all__
    assert 15 <= len(names) <= 18, names
    assert len(set(names)) == len(names)
    for name in names:
        assert getattr(clipamp_engine, name) is not None
    namespace: dict = {}
    exec("from clipamp_engine import *", namespace)
    assert set(names) <= set(namespace)
    contract = {
        "AmpTrainState",
        "StepLog",
        "SkipLog",
        "CANONICAL_COLUMNS",
        "clip_global_l2_norm",
        "has_non_finite_grad",
    }
    assert contract <= set(names)


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("StagedNormClip", "clipamp_engine.clip"),
        ("CLIP_MODES", "clipamp_engine.clip"),
        ("clip_mode_options", "clipamp_engine.clip"),
        ("NormCalibrator", "clipamp_engine.calibration"),
        ("CalibrationWindows", "clipamp_engine.calibration"),
        ("RollingRate", "clipamp_engine.monitors"),
        ("SkipRateMonitor", "clipamp_engine.monitors"),
        ("DTYPES", "clipamp_engine.step"),
        ("parse_dtype", "clipamp_engine.step"),
        ("StepForensics", "clipamp_engine.forensics"),
        ("diagnose", "clipamp_engine.diagnosis"),
        ("LossScaleFloorWarning", "clipamp_engine.scaling"),
        ("SKIP_REASONS", "clipamp_engine.records"),
    ],
)
def test_internals_stay_importable_from_their_module(name, module):
    assert name not in clipamp_engine.__all__
    assert hasattr(importlib.import_module(module), name)


@pytest.mark.parametrize("module", ["fused.py", "fused_step.py"])
def test_fused_path_asks_policies_instead_of_checking_their_type(module):
    """No ``type(x) is …`` / ``type(x) in …`` / ``isinstance(…, <a policy>)`` in the fused path, and no
    private attribute but those of the ``AmpTrainState`` (``state``) whose fused step ``fused_step.py`` is."""
    tree = ast.parse((ENGINE / module).read_text())
    policies = set(importlib.import_module("clipamp_engine.clip").__all__)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                if isinstance(side, ast.Call) and isinstance(side.func, ast.Name) and side.func.id == "type":
                    pytest.fail(f"{module}:{node.lineno} compares type(...)")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("isinstance", "issubclass"):
                used = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                assert not used & policies, f"{module}:{node.lineno} checks a policy class"
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            own = isinstance(node.value, ast.Name) and node.value.id == "state" and module == "fused_step.py"
            assert own, f"{module}:{node.lineno} reads private attribute {node.attr!r}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clip"):
            assert {a.name for a in node.names} <= {"ClipPolicy"}, f"{module}:{node.lineno} imports policy classes"


def test_engine_never_imports_the_app_or_its_libraries():
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert not roots & APP_LIBRARIES, f"{path.relative_to(ENGINE)}:{node.lineno} imports {roots}"


def test_private_torch_symbols_are_used_only_in_the_compat_module():
    for path, tree in _modules().items():
        if path == COMPAT:
            continue
        where = path.relative_to(ENGINE)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                assert node.attr not in PRIVATE_TORCH, f"{where}:{node.lineno} uses {node.attr}"
                if isinstance(node.value, ast.Name) and node.value.id == "sys":
                    assert node.attr != "modules", f"{where}:{node.lineno} probes sys.modules"
                if isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr.startswith("_"):
                    assert node.attr.startswith("_foreach_"), f"{where}:{node.lineno} uses torch.{node.attr}"
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
                private = [a.name for a in node.names if a.name.startswith("_") or a.name in PRIVATE_TORCH]
                assert not private and "._" not in node.module, f"{where}:{node.lineno} imports {private}"


def test_old_scaler_knobs_are_a_type_error_naming_scaler():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"through scaler=.*init_scale.*growth_interval") as err:
        AmpTrainState(model, opt, F.mse_loss, dtype="fp16", init_scale=1024.0, growth_interval=5)
    assert "scaler=LossScaler(device, init_scale=1024.0, growth_interval=5)" in str(err.value)
    with pytest.raises(TypeError, match="unexpected keyword arguments: max_nrom"):
        AmpTrainState(model, opt, F.mse_loss, max_nrom=1.0)
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp16", scaler=LossScaler("cpu", init_scale=1024.0))
    assert state.scaler.get_scale() == 1024.0


def test_default_scaler_is_enabled_for_fp16_only():
    model = Tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert AmpTrainState(model, opt, F.mse_loss, dtype="fp16").scaler.is_enabled()
    assert not AmpTrainState(model, opt, F.mse_loss, dtype="bf16").scaler.is_enabled()
