"""The schema is the one home of the config: clip options tied to the engine's, YAML files that
set only what differs from it, choices checked from the fields that declare them."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import torch
import yaml

from clipamp_engine import CalibratedClip, make_clip_policy
from clipamp_engine.calibration import DEFAULT_CANDIDATES, DEFAULT_QUANTILE, DEFAULT_WINDOW
from clipamp_engine.clip import CLIP_MODES, clip_mode_options
from clipamp_engine.clip.calibrated import RECOMMENDED
from sweep.config import validate
from sweep.config.schema import CalibrateConfig, ClipConfig, Config, calibrated
from sweep.errors import UserError
from sweep.run.build import build_clip_policy, clip_options
from tests.app.helpers import CONF, compose_cfg

#: Deliberate app choices that differ from the engine's defaults (behaviour kept from before the
#: restructuring): clip=quantile guards against spikes (top decile) where AutoClip's paper default
#: p=10 clips ~90% of steps; clip=staged shows a two-stage schedule, not the engine's single stage.
#: ``per_group.patterns``: ``{}`` means what the engine's ``None`` means (by param group), and a
#: command line can add entries to it (``+clip.patterns={attn: 0.5}``), which a ``null`` refuses.
APP_CHOICES = {
    ("quantile", "quantile"): 0.9,
    ("staged", "stages"): [[0.0, 2.0], [100.0, 1.0]],
    ("per_group", "patterns"): {},
}
GROUPS = ("model", "data", "optim", "amp", "calibrate", "tracking", "study")


#: The clip modes whose options are ``clip.*`` (``clip=calibrated``'s are ``calibrate.*``).
CLIP_GROUP_MODES = sorted(set(CLIP_MODES) - {"calibrated"})


def test_clip_config_holds_exactly_the_engine_options():
    options = {k for mode in CLIP_GROUP_MODES for k in clip_mode_options(mode)}
    fields = {f.name for f in dataclasses.fields(ClipConfig)} - {"mode"}
    assert fields == options, f"missing from ClipConfig: {options - fields}; not an engine option: {fields - options}"
    calibrate = {f.name for f in dataclasses.fields(CalibrateConfig)}
    assert calibrate == set(clip_mode_options("calibrated"))  # calibrate.* is clip=calibrated's one home


@pytest.mark.parametrize("mode", CLIP_GROUP_MODES)
def test_clip_yaml_lists_every_option_of_its_mode_at_the_engine_default(mode):
    values = yaml.safe_load((CONF / "clip" / f"{mode}.yaml").read_text())
    assert values.pop("mode") == mode
    defaults = clip_mode_options(mode)
    assert set(values) == set(defaults), mode
    for key, value in values.items():
        expected = APP_CHOICES.get((mode, key), defaults[key])
        assert value == expected, f"conf/clip/{mode}.yaml {key}={value!r}, engine default {defaults[key]!r}"
        if (mode, key) in APP_CHOICES:
            assert value != defaults[key], f"{mode}.{key} now equals the engine default: drop it from APP_CHOICES"
    cfg = compose_cfg("+experiment=train", f"clip={mode}")
    assert clip_options(cfg) == {k: v for k, v in values.items() if v is not None}  # nothing dropped
    model = torch.nn.Linear(2, 2)
    make_clip_policy(
        mode, named_params=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **clip_options(cfg)
    )  # and the engine takes them


#: A compose per numeric option of the mode: calibrated and norm stay in the fast subset, the other modes are slow.
@pytest.mark.parametrize(
    "mode", [m if m in ("calibrated", "norm") else pytest.param(m, marks=pytest.mark.slow) for m in sorted(CLIP_MODES)]
)
def test_every_engine_option_is_reachable_by_override(mode):
    group = "calibrate" if mode == "calibrated" else "clip"
    for key, default in clip_mode_options(mode).items():
        if isinstance(default, (bool, int, float)) and not isinstance(default, bool):
            cfg = compose_cfg("+experiment=train", f"clip={mode}", f"{group}.{key}={default * 2}")
            assert clip_options(cfg)[key] == default * 2


def _schema_default(node: object, key: str):
    f = {f.name: f for f in dataclasses.fields(node)}[key]
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("group", GROUPS)
def test_group_files_set_only_what_differs_from_the_schema(group):
    node = getattr(Config(), group)
    for path in sorted((CONF / group).glob("*.yaml")):
        values = yaml.safe_load(path.read_text()) or {}
        for key, value in values.items():
            if value == path.stem:  # the key naming the option itself (name: gpt, dtype: fp16, mode: pareto)
                continue
            assert value != _schema_default(node, key), f"{path.relative_to(CONF)}: {key}={value!r} is the default"


#: The groups whose file picks a choice of the schema: ``GROUP=OPTION`` for each option.
SELECTORS = {"model": "name", "data": "name", "optim": "name", "amp": "dtype", "clip": "mode", "study": "mode"}


@pytest.mark.parametrize("group", sorted(SELECTORS))
def test_every_choice_of_a_group_is_a_group_option(group):
    """``optim=adam`` was "Could not find 'optim/adam'" though ``optim.name=adam`` is a choice: each
    choice is a file of its group, and that file selects it."""
    key = SELECTORS[group]
    choices = {f.name: f for f in dataclasses.fields(getattr(Config(), group))}[key].metadata["choices"]
    files = {p.stem for p in (CONF / group).glob("*.yaml")}
    assert set(choices) <= files, f"conf/{group}/ has no file for {sorted(set(choices) - files)}"
    experiment = "+experiment=sweep" if group == "study" else "+experiment=train"
    for option in choices:
        cfg = compose_cfg(experiment, f"{group}={option}")
        assert getattr(getattr(cfg, group), key) == option, (group, option)


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def test_top_level_and_experiment_files_set_only_what_they_change():
    top = yaml.safe_load((CONF / "config.yaml").read_text())
    plain = {k: v for k, v in top.items() if k not in ("defaults", "hydra")}
    assert all(v != getattr(Config(), k) for k, v in plain.items()), plain
    base = compose_cfg()
    for path in sorted((CONF / "experiment").glob("*.yaml")):
        for key, value in _leaves(yaml.safe_load(path.read_text())).items():
            node = base
            for part in key.split("."):
                node = getattr(node, part)
            assert value != node, f"{path.relative_to(CONF)}: {key}={value!r} is already the composed default"


@pytest.mark.parametrize(
    "override,message",
    [
        ("optim.name=rmsprop", "optim.name='rmsprop' is not one of adamw, adam, sgd"),
        ("optim.schedule=step", "optim.schedule='step' is not one of cosine, linear, constant"),
        ("study.sampler=grid", "study.sampler='grid' is not one of tpe, random, nsga2"),
        ("model.name=mlp", "model.name='mlp' is not one of gpt, lstm, linear, custom, hf: pass model=gpt"),
    ],
)
def test_choices_are_checked_from_the_schema(override, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(compose_cfg("+experiment=train", override))


def test_calibrate_defaults_are_the_engines_calibrated_clip():
    engine = clip_mode_options("calibrated")
    assert dataclasses.asdict(CalibrateConfig()) == engine  # every CalibratedClip option, at its default
    assert yaml.safe_load((CONF / "clip" / "calibrated.yaml").read_text()) == {"mode": "calibrated"}
    assert (engine["window"], engine["quantile"], engine["candidates"]) == (
        DEFAULT_WINDOW,
        DEFAULT_QUANTILE,
        list(DEFAULT_CANDIDATES),
    )


def test_clip_calibrated_reads_calibrate():
    cfg = compose_cfg("+experiment=train", "clip=calibrated", "calibrate.window=30", "calibrate.start=7")
    options = clip_options(cfg)
    assert options == {**dataclasses.asdict(cfg.calibrate), "window": 30, "start": 7}
    policy = build_clip_policy(cfg, total_steps=100)
    assert (policy.window, policy.start, policy.quantile) == (30, 7, DEFAULT_QUANTILE)
    # what +experiment=calibrate runs: the same policy, from the experiment's calibrate.*
    cal = compose_cfg("+experiment=calibrate")
    assert calibrated(cal).clip == ClipConfig(mode="calibrated")
    runner = build_clip_policy(calibrated(cal), total_steps=cal.steps)
    banded = CalibratedClip(**dataclasses.asdict(cal.calibrate), total_steps=cal.steps)
    assert runner.quantile == banded.quantile == pytest.approx(1 - sum(cal.calibrate.target_clip) / 2)


def test_the_calibrate_experiment_states_the_engines_recommended_calibration():
    """conf/experiment/calibrate.yaml writes the values of RECOMMENDED that differ from CalibratedClip's
    defaults (Hydra needs literals): together they are RECOMMENDED."""
    recommended = {k: list(v) if isinstance(v, tuple) else v for k, v in RECOMMENDED.items()}
    defaults = dataclasses.asdict(CalibrateConfig())
    stated = yaml.safe_load((CONF / "experiment" / "calibrate.yaml").read_text())["calibrate"]
    assert stated == {k: v for k, v in recommended.items() if v != defaults[k]}
    assert dataclasses.asdict(compose_cfg("+experiment=calibrate").calibrate) == recommended


@pytest.mark.parametrize(("override", "key"), [("clip.quantile=0.9", "quantile"), ("clip.max_norm=1.0", "max_norm")])
def test_a_clip_option_under_clip_calibrated_is_refused_naming_its_calibrate_key(override, key):
    cfg = compose_cfg("+experiment=train", "clip=calibrated", override)
    value = override.split("=")[1]
    fix = f"pass calibrate.{key}={value} instead" if key == "quantile" else f"drop clip.{key}"
    with pytest.raises(UserError) as e:
        build_clip_policy(cfg)
    assert str(e.value) == f"clip.{key}={value}: clip=calibrated reads its options from calibrate.*; {fix}"


def test_per_group_patterns_can_be_given_on_the_command_line():
    cfg = compose_cfg("+experiment=train", "clip=per_group", "+clip.patterns={attn: 0.5, mlp: 1.0}")
    options = clip_options(cfg)
    assert options["patterns"] == {"attn": 0.5, "mlp": 1.0}
    model = torch.nn.ModuleDict({"attn": torch.nn.Linear(2, 2), "mlp": torch.nn.Linear(2, 2)})
    policy = make_clip_policy("per_group", named_params=model, **options)
    assert policy.max_norms[:2] == [0.5, 1.0]  # attn's parameters at 0.5, mlp's at 1.0 (then the rest)


@pytest.mark.parametrize("pattern", ["^0", r"^0\.weight$"])
def test_clip_patterns_name_the_users_parameters_inside_the_own_loss_wrapper(pattern):
    """model.loss_target=model wraps the model (names ``model.0.weight``, and ``module.`` under DDP); an
    anchored pattern (a clip YAML of one's own: Hydra's override grammar has no ``^`` in a key) written against
    the user's names, as model.freeze takes them, selected nothing and clipped nothing."""
    from sweep.tasks.own_loss import OwnLossModel

    cfg = compose_cfg("+experiment=train", "clip=per_group")
    cfg = dataclasses.replace(cfg, clip=dataclasses.replace(cfg.clip, patterns={pattern: 0.5}))
    torch.manual_seed(0)
    user = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    ref = copy.deepcopy(user)
    for a, b in zip(user.parameters(), ref.parameters()):
        a.grad, b.grad = torch.full_like(a, 10.0), torch.full_like(b, 10.0)
    policy = build_clip_policy(cfg, OwnLossModel(user), torch.optim.SGD(user.parameters(), lr=0.1))
    params = list(user.parameters())
    pre = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    policy.clip_(params, [p.grad for p in params], pre, 1)
    torch.nn.utils.clip_grad_norm_([p for n, p in ref.named_parameters() if re.search(pattern, n)], 0.5)
    for a, b in zip(user.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
