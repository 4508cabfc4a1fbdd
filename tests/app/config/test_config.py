"""The conf/ tree composes for every experiment; user mistakes give one line and exit 2."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from sweep.config import validate
from sweep.config.schema import RUNS, calibrated
from sweep.config.validate import clip_options
from sweep.errors import UserError
from sweep.run.build import build_clip_policy
from sweep.run.faults import FAULTS
from tests.app.helpers import EXPERIMENTS, compose_cfg, run_cli, run_cli_here


def test_every_experiment_file_is_a_known_run():
    assert set(EXPERIMENTS) >= {"calibrate", "train"}
    for name in EXPERIMENTS:
        cfg = compose_cfg(f"+experiment={name}")
        assert cfg.run == name and cfg.run in RUNS
        validate(cfg)


def test_defaults_are_the_documented_ones():
    cfg = compose_cfg("+experiment=calibrate")
    assert (cfg.model.name, cfg.data.name, cfg.amp.dtype, cfg.clip.mode) == ("gpt", "stdlib", "bf16", "norm")
    assert cfg.clip.max_norm == 1.0
    # the calibrate experiment: window placed after warm-up and transient, τ aimed at the [1%, 5%] band
    c = cfg.calibrate
    assert (cfg.steps, c.start, c.window, c.quantile, c.target_clip, c.validate) == (
        500,
        "auto",
        200,
        None,
        [0.01, 0.05],
        0,
    )
    assert compose_cfg("+experiment=train").calibrate.start == 0  # elsewhere the window starts at step 1
    assert cfg.tracking.uri is None  # → $MLFLOW_TRACKING_URI or sqlite:///mlruns/mlflow.db


def test_common_overrides_compose():
    cfg = compose_cfg(
        "+experiment=calibrate",
        "steps=50",
        "seed=3",
        "model=lstm",
        "amp.dtype=fp16",
        "clip.max_norm=2.5",
        "calibrate.window=20",
        "calibrate.quantile=0.9",
        "tracking.uri=sqlite:///x/mlflow.db",
    )
    assert (cfg.steps, cfg.seed, cfg.model.name, cfg.amp.dtype) == (50, 3, "lstm", "fp16")
    assert (cfg.clip.max_norm, cfg.calibrate.window, cfg.calibrate.quantile) == (2.5, 20, 0.9)


@pytest.mark.parametrize("run", ["calibrate", "train"])
def test_clip_quantile_is_refused_naming_calibrate_quantile_in_a_calibrate_run(run):
    """clip.quantile is AutoClip's (clip=quantile); a calibrate run that passes it meant calibrate.quantile."""
    with pytest.raises(UserError) as e:
        clip_options(compose_cfg(f"+experiment={run}", "clip.quantile=0.99"))
    refusal = "clip=norm does not take clip.quantile; its options are max_norm"
    hint = "; +experiment=calibrate reads calibrate.*: pass calibrate.quantile=0.99"
    assert str(e.value) == refusal + (hint if run == "calibrate" else "")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["calibrate.quantile=1.5"], "calibrate.quantile=1.5 must be in (0, 1)"),
        (["calibrate.start=later"], "calibrate.start='later' must be auto or a number of steps >= 0"),
        (  # the fix is +experiment=calibrate's own default (auto, window 200, null quantile), not the schema's
            ["calibrate.start=-3"],
            "calibrate.start=-3 must be auto or a number of steps >= 0 (0: the window starts at step 1): "
            "pass e.g. calibrate.start=auto",
        ),
        (
            ["calibrate.start=400", "calibrate.window=200"],
            "calibrate.start=400 + calibrate.window=200 is larger than steps=500",
        ),
        (["calibrate.validate=-1"], "calibrate.validate=-1 must be a number of steps >= 0"),
        (["calibrate.window=1"], "calibrate.window=1 must be an integer >= 2 steps: pass e.g. calibrate.window=200"),
        (
            ["calibrate.every=50"],
            "calibrate.every=50 must be 0 (one window) or an integer >= calibrate.window=200: "
            "pass e.g. calibrate.every=0",
        ),
        (
            ["calibrate.cap=-1"],
            "calibrate.cap=-1.0 must be a finite number > 0: "
            "pass e.g. calibrate.cap=null (no clipping during the window)",
        ),
        (
            ["calibrate.quantile=2"],
            "calibrate.quantile=2.0 must be in (0, 1), e.g. 0.95: pass e.g. calibrate.quantile=null "
            "(aim τ at calibrate.target_clip)",
        ),
        (
            ["calibrate.target_clip=[0.05,0.01]"],
            "calibrate.target_clip=[0.05, 0.01] needs 0 <= low < high <= 1 (τ aims at the band's midpoint and its "
            "held-out steps are judged against it, so it needs a width)",
        ),
        (
            ["calibrate.confidence=1.5"],
            "calibrate.confidence=1.5 must be in (0, 1), e.g. 0.95 (the intervals' level): "
            "pass e.g. calibrate.confidence=0.95",
        ),
        (
            ["calibrate.candidates=[-1]"],
            "calibrate.candidates=[-1.0] must be finite numbers > 0 (fixed thresholds whose clipping ratio the "
            "window reports): pass e.g. calibrate.candidates=[0.5,1.0,2.0,5.0]",
        ),
        (
            ["calibrate.candidates=[2,0.5,2]"],
            "calibrate.candidates=[2.0, 0.5, 2.0] lists 2 more than once: each is one threshold whose clipping ratio "
            "the window reports, so drop the repeat: pass e.g. calibrate.candidates=[0.5,1.0,2.0,5.0]",
        ),
        (["calibrate.quantile=0"], "calibrate.quantile=0.0 must be in (0, 1)"),
        (["amp.dtype=fp8"], "amp.dtype='fp8' is not one of bf16, fp16, fp32"),
        (["steps=0"], "steps=0 must be >= 1"),
        (["steps=10", "calibrate.window=20"], "calibrate.window=20 is larger than steps=10"),
        (
            ["steps=5"],  # calibrate.start=auto: no start of the user's to name
            "calibrate.window=200 is larger than steps=5: lower calibrate.window, or raise steps",
        ),
        (["accumulation_steps=0"], "accumulation_steps=0 must be >= 1"),
        (
            ["clip=value", "clip.clip_value=0.1"],
            "clip=value: +experiment=calibrate trains at its calibrated τ (clip=calibrated, whose options are "
            "calibrate.*), so the clip group would be ignored: drop it, or run +experiment=train clip=value",
        ),
        (["clip.max_norm=2"], "clip.max_norm=2.0: +experiment=calibrate trains at its calibrated τ"),
    ],
)
def test_semantic_checks_name_the_value(overrides, message):
    cfg = compose_cfg("+experiment=calibrate", *overrides)
    with pytest.raises(UserError) as e:
        validate(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_no_candidates_is_a_calibration_that_reports_the_quantiles_and_tau_only():
    """``calibrate.candidates=[]`` passes and builds the policy the engine builds with ``candidates=()``, as
    ``python -m sweep.recommend --candidates`` (the flag alone) replays it; a run's ``[]`` param reads back so."""
    from clipamp_engine.clip import CalibratedClip
    from sweep.recommend import cli
    from sweep.recommend.replay import as_flag, run_settings

    cfg = compose_cfg("+experiment=calibrate", "calibrate.candidates=[]")
    validate(cfg)
    policy = build_clip_policy(calibrated(cfg), total_steps=cfg.steps)
    assert isinstance(policy, CalibratedClip) and policy.candidates == ()
    assert cli.parser().parse_args(["steps.csv", *as_flag("candidates", ()).split()]).candidates == []
    assert run_settings({"calibrate.candidates": "[]"}) == {"candidates": ()}


@pytest.mark.parametrize("value", ["-1", "0"])
def test_a_clip_threshold_out_of_range_names_the_value(value):
    with pytest.raises(UserError) as e:
        validate(compose_cfg("+experiment=train", f"clip.max_norm={value}"))
    assert str(e.value).startswith(f"clip.max_norm={float(value)} must be > 0")


@pytest.mark.parametrize(
    "override,message",
    [
        ("+clip.maxnorm=0.1", "clip.maxnorm is not a key of clip: did you mean clip.max_norm? its keys are alpha, "),
        ("+stepz=60", "stepz is not a key of the config: did you mean steps? its keys are accumulation_steps, "),
        ("+calibrate.windw=3", "calibrate.windw is not a key of calibrate: did you mean calibrate.window? its keys"),
        ("+tracking.foo.bar=1", "tracking.foo is not a key of tracking: its keys are "),
    ],
)
def test_a_key_the_schema_lacks_is_refused_not_ignored(override, message):
    """Hydra adds a ``+key`` to the composed tree and the run then ignored it (``+stepz=60`` ran 300 steps)."""
    with pytest.raises(UserError) as e:
        compose_cfg("+experiment=train", override)
    assert str(e.value).startswith(message)


def test_keys_under_a_free_form_field_are_the_users_own():
    cfg = compose_cfg("+experiment=train", "model=custom", "model._target_=m.M", "+model.kwargs.width=3")
    assert cfg.model.kwargs == {"width": 3}


BAD_INPUTS = [  # (arguments, what the one line must say); each also runs with steps=5
    (["+experiment=sweep", "resume=true"], "resume=true: a sweep resumes its study when the same command is run"),
    (["+experiment=sweep", "study=entangle", "resume=last"], "resume=last: the LR check (study=entangle) is not"),
    (["+experiment=train", "clip.max_norm=-1"], "clip.max_norm=-1.0 must be > 0"),
    (["+experiment=train", "clip.max_norm=0"], "clip.max_norm=0.0 must be > 0"),
    (["+experiment=calibrate", "clip=value"], "clip=value: +experiment=calibrate trains at its calibrated τ"),
    (["+experiment=calibrate", "calibrate.quantile=1.5"], "calibrate.quantile=1.5 must be in (0, 1)"),
    (["+experiment=calibrate", "amp.dtype=fp8"], "amp.dtype='fp8' is not one of bf16, fp16, fp32"),
    (["+experiment=calibrate", "steps=0"], "steps=0 must be >= 1"),
    (["+experiment=calibrate", "steps=abc"], "steps=abc"),
    (["+experiment=calibrate", "steps=5", "calibrate.window=50"], "calibrate.window=50 is larger than steps=5"),
    (["+experiment=calibrate", "accumulation_steps=0"], "accumulation_steps=0 must be >= 1"),
    (
        ["+experiment=calibrate", "model=foo"],
        "Could not find 'model/foo' Available options in 'model': custom gpt hf hf_gpt2 hf_llama linear lstm",
    ),
    (["+experiment=calibrate", "data=nope"], "Could not find 'data/nope'"),
    (["+experiment=calibrate", "clip=bogus"], "Could not find 'clip/bogus'"),
    (["+experiment=train", "clip=value", "clip.max_norm=2"], "clip=value does not take clip.max_norm"),
    (
        ["+experiment=calibrate", "clip.quantile=0.99"],
        "error: clip=norm does not take clip.quantile; its options are max_norm; "
        "+experiment=calibrate reads calibrate.*: pass calibrate.quantile=0.99",
    ),
    (
        ["+experiment=train", "clip=calibrated", "clip.quantile=0.9"],
        "error: clip.quantile=0.9: clip=calibrated reads its options from calibrate.*; pass calibrate.quantile=0.9",
    ),
    (["+experiment=train", "clip=calibrated", "clip.window=50"], "error: clip.window is now calibrate.window"),
    (["+experiment=calibrate", "stepz=3"], "stepz is not a key of the config: did you mean steps?"),
    (["+experiment=calibrate", "+stepz=3"], "stepz is not a key of the config: did you mean steps?"),
    (["+experiment=train", "+clip.maxnorm=1"], "clip.maxnorm is not a key of clip: did you mean clip.max_norm?"),
    (  # only clip=per_group starts a clip.patterns table: entries elsewhere are the mode's refusal, not OmegaConf's
        ["+experiment=train", "+clip.patterns={attn: 0.5}"],
        "error: clip=norm does not take clip.patterns; its options are max_norm",
    ),
    (
        ["+experiment=train", "clip=zscore", "++clip.patterns.attn=0.5"],
        "error: clip=zscore does not take clip.patterns",
    ),
    (["+experiment=calibrate", "clip.patterns={attn: 0.5}"], "error: clip.patterns={attn: 0.5}: +experiment=calibrate"),
    (["+experiment=nope"], "Could not find 'experiment/nope'"),
    ([], "no experiment chosen: add +experiment=NAME"),
    (["+experiment=calibrate", "clip=norm"], "error: clip=norm: +experiment=calibrate trains at its calibrated τ"),
    (["+experiment=calibrate", "clip.max_norm=1"], "error: clip.max_norm=1: +experiment=calibrate trains at its"),
    (["experiment=calibrate"], "error: experiment=calibrate needs a +: pass +experiment=calibrate (an experiment is"),
    (
        ["+experiment=calibrate", "data=text", "data.path=/nonexistent/corpus.txt"],
        "data.path='/nonexistent/corpus.txt' does not exist",
    ),
    (["+experiment=calibrate", "data=text", "data.path=EMPTY"], "is empty (0 bytes)"),
    (
        ["+experiment=calibrate", "model=custom", "model._target_=no_such_pkg.Model"],
        "model._target_='no_such_pkg.Model' could not be imported",
    ),
    (["+experiment=calibrate", "+model.d=64"], "model.d is not a key of model=gpt"),
    (
        [
            "+experiment=calibrate",
            "model=custom",
            "model._target_=torch.nn.Sequential",
            "+model._args_=[{_target_: torch.nn.Embedding, num_embeddings: 256, embedding_dim: 8},"
            " {_target_: no_such.Layer}]",
        ],
        "Error locating target 'no_such.Layer'",
    ),
    (["+experiment=calibrate", "device=cuda"], "device='cuda' is not available here"),
    (["+experiment=sweep", "study.target_clip_high=0.3"], "study.target_clip_high is now study.target_clip=[low,high]"),
    (["+experiment=calibrate", "tracking.uri=file:///tmp/x"], "tracking.uri='file:///tmp/x' is not supported"),
    (["+experiment=calibrate", "tracking.uri=http://127.0.0.1:9/"], "is unreachable"),
    (["+experiment=calibrate", "tracking.uri=sqlite:///BLOCKED/mlruns/mlflow.db"], "cannot write in"),
]


#: One mistake refused at each stage (the precheck, validation, the task's build, the store), run as a new process.
IN_A_PROCESS = ("no experiment chosen", "clip.max_norm=-1.0 must", "Error locating target", "is unreachable")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message", "process"),
    [(a, m, m.startswith(IN_A_PROCESS)) for a, m in BAD_INPUTS],
    ids=[m[:40] for _, m in BAD_INPUTS],
)
def test_cli_user_mistakes_exit_2_with_one_line_and_leave_no_running_run(
    tmp_path, args, message, process, store, capsys, monkeypatch
):
    """Every mistake through the CLI's entry point in this process (``run_cli_here``: seconds less each); one per
    stage as ``python -m sweep`` in a new process instead, with the exit status Python gives. The default store
    is made already (a mistake found after it opens must leave no run in it RUNNING)."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blocker").write_text("a file where a folder should be")
    args = [a.replace("EMPTY", str(tmp_path / "empty.txt")).replace("BLOCKED", str(tmp_path / "blocker")) for a in args]
    extra = ["progress=false", "calibrate.window=2"] + (
        [] if any(a.startswith("steps=") for a in args) else ["steps=5"]
    )
    argv = [*(extra if args else []), *args]
    here = {"capsys": capsys, "monkeypatch": monkeypatch}
    res = run_cli(*argv, cwd=tmp_path) if process else run_cli_here(*argv, cwd=tmp_path, **here)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], res.stderr
    assert "Traceback" not in res.stderr
    db = tmp_path / "mlruns" / "mlflow.db"
    if db.exists():
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{db}")
        exps = [e.experiment_id for e in client.search_experiments()]
        assert not client.search_runs(exps, filter_string="attributes.status = 'RUNNING'")


@pytest.mark.parametrize(
    ("argv", "key", "default"),
    [
        (["+experiment=calibrate", "calibrate.target_clip=0.05"], "calibrate.target_clip", "[0.01,0.05]"),
        (["+experiment=train", "clip=staged", "clip.stages=[[1,2],3]"], "clip.stages", "[[0.0,2.0],[100.0,1.0]]"),
        (["-m", "+experiment=sweep", "study.dtypes=fp16", "seed=0,1"], "study.dtypes", "[fp16,bf16]"),
    ],
)
def test_a_list_key_given_a_scalar_names_its_shape_and_a_default_that_composes(argv, key, default, capsys):
    """``calibrate.target_clip=0.05`` was OmegaConf's "Error merging override …: Invalid value assigned: float is
    not a ListConfig, list or tuple."; the line now says the key is a list and gives one, its default, to paste."""
    from sweep.__main__ import precheck

    with pytest.raises(SystemExit) as e:
        precheck(argv)
    assert e.value.code == 2
    given = next(a for a in argv if a.startswith(f"{key}="))
    shape = "a list of lists" if default.startswith("[[") else "a list"
    line = capsys.readouterr().err.strip()
    assert line == f"error: {given}: {key} is {shape}: pass e.g. '{key}={default}' (its default)"
    job = [a for a in argv if a not in (given, "-m") and "," not in a]
    pasted = OmegaConf.select(OmegaConf.structured(compose_cfg(*job, f"{key}={default}")), key)
    assert OmegaConf.to_container(pasted) == OmegaConf.to_container(
        OmegaConf.select(OmegaConf.structured(compose_cfg(*job)), key)
    )


@pytest.mark.parametrize("key", ["study.target_clip_low", "+study.target_clip_high"])
def test_the_old_band_spelling_is_refused_naming_the_new_key(key, capsys):
    from sweep.__main__ import precheck

    with pytest.raises(SystemExit) as e:
        precheck(["+experiment=sweep", f"{key}=0.1"])
    assert e.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line == (
        f"error: {key.lstrip('+')} is now study.target_clip=[low,high], one band as in calibrate.target_clip: "
        "pass e.g. study.target_clip=[0.01,0.2]"
    )


@pytest.mark.parametrize(
    ("study", "override", "why"),
    [
        ([], "study.pruner=median", "a multi-objective study cannot prune"),
        ([], "study.prune_warmup=0.5", "a multi-objective study cannot prune"),
        (["study=entangle"], "study.report_every=3", "it runs every cell of its grid"),
        (["study=entangle"], "study.prune_below_after=null", "it runs every cell of its grid"),
    ],
)
def test_a_pruning_key_a_study_would_ignore_is_refused(study, override, why, capsys):
    """``study.pruner=median`` under the default ``study=pareto`` ran the sweep unpruned without a word."""
    from sweep.__main__ import precheck
    from sweep.config.schema import StudyConfig
    from sweep.config.validate import PRUNING_KEYS

    mode = study[0].split("=")[1] if study else "pareto"
    with pytest.raises(SystemExit) as e:
        precheck(["+experiment=sweep", *study, override])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {override}: study={mode} prunes no trial ({why}), so it would be ignored: drop it, or pass "
        "study=constrained, whose trials are pruned"
    )
    for fine in (["study=constrained", override], [*study, "study.pruner=none"]):
        precheck(["+experiment=sweep", *fine])  # pruned trials, or the pruning it has: accepted
    assert set(PRUNING_KEYS) <= {f"study.{f}" for f in StudyConfig.__dataclass_fields__}  # a rename keeps it alive


@pytest.mark.parametrize(
    ("override", "key"),
    [("clip.window=50", "window"), ("clip.start=auto", "start"), ("+clip.target_clip=[0.01,0.1]", "target_clip")],
)
def test_a_calibration_option_under_clip_is_refused_naming_its_calibrate_key(override, key, capsys):
    from sweep.__main__ import precheck

    with pytest.raises(SystemExit) as e:
        precheck(["+experiment=train", "clip=calibrated", override])
    assert e.value.code == 2
    value = override.split("=", 1)[1]
    assert capsys.readouterr().err.strip() == (
        f"error: clip.{key} is now calibrate.{key}: clip=calibrated reads its options from calibrate.*; "
        f"pass calibrate.{key}={value}"
    )
    cfg = compose_cfg("+experiment=train", "clip=calibrated", f"calibrate.{key}={value}")  # and that key works
    assert str(getattr(cfg.calibrate, key)).replace(" ", "") == value


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["clip=calibrated", "clip.quantile=0.9"],
            "clip.quantile=0.9: clip=calibrated reads its options from calibrate.*; "
            "pass calibrate.quantile=0.9 instead",
        ),
        (
            ["clip=calibrated", "clip.max_norm=1.0"],
            "clip.max_norm=1.0: clip=calibrated reads its options from calibrate.*; drop clip.max_norm",
        ),
        (["clip=zscore", "clip.max_norms=[1.0]"], "clip=zscore does not take clip.max_norms; its options are"),
        (["clip.mode=nrom"], "clip.mode='nrom' is not one of norm, "),
    ],
)
def test_clip_options_of_another_home_are_refused_before_a_run_opens(args, message):
    with pytest.raises(UserError) as e:
        validate(compose_cfg("+experiment=train", *args))
    assert str(e.value).startswith(message)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["clip=zscore", "clip.alpha=1.5"], "clip.alpha=1.5 must be in (0, 1): pass e.g. clip.alpha=0.97"),
        (
            ["clip=norm", "clip.max_norm=-1"],
            "clip.max_norm=-1.0 must be > 0 (use clip=none to disable clipping): pass e.g. clip.max_norm=1.0",
        ),
        (
            ["clip=agc", "clip.clip_factor=0"],
            "clip.clip_factor=0.0 must be a finite number > 0: pass e.g. clip.clip_factor=0.01",
        ),
        (
            ["clip=zscore", "clip.clip_option=x"],
            "clip.clip_option='x' is not one of adaptive_scaling, mean: pass e.g. clip.clip_option=adaptive_scaling",
        ),
        (
            ["clip=staged", "clip.stages=[[5.0,1.0],[0.0,2.0]]"],
            "clip.stages=[[5.0, 1.0], [0.0, 2.0]]: start steps must be strictly increasing: "
            "pass e.g. clip.stages=[[0,1.0]]",
        ),
    ],
)
def test_the_clip_policy_checks_its_options_named_by_config_key(args, message):
    """validate() builds the engine's policy of clip.mode: its ValueError is one line in clip.* keys."""
    with pytest.raises(UserError) as e:
        validate(compose_cfg("+experiment=train", *args))
    assert str(e.value) == message


def test_each_band_admits_its_ends_and_says_why_its_bounds_are_what_they_are():
    """A calibrate band is a target (τ aims at its midpoint) and needs a width, but may start at 0 (no floor)
    or end at 1 (no ceiling), as a study's band, a constraint, may; only the study's may be one ratio."""
    from clipamp_engine.band import check_band

    cfg = compose_cfg("+experiment=calibrate", "calibrate.target_clip=[0,0.05]")
    validate(cfg)
    assert build_clip_policy(calibrated(cfg), total_steps=cfg.steps).quantile == pytest.approx(1 - (0 + 0.05) / 2)
    assert check_band(2.0, 0.02, 0, 100, (0.0, 0.05)).inside  # no step clipped: inside a band with no floor
    assert not check_band(2.0, 0.02, 0, 100, (0.01, 0.05)).inside
    validate(compose_cfg("+experiment=calibrate", "calibrate.target_clip=[0.5,1]"))
    validate(compose_cfg("+experiment=sweep", "study.target_clip=[0,1]"))  # every trial feasible
    validate(compose_cfg("+experiment=sweep", "study.target_clip=[0,0]"))  # only trials that never clip
    with pytest.raises(UserError, match=r"needs 0 <= low < high <= 1 \(τ aims at the band's midpoint"):
        validate(compose_cfg("+experiment=calibrate", "calibrate.target_clip=[0.05,0.05]"))
    with pytest.raises(UserError, match=r"\(a constraint on each trial's clipping ratio: \[0,1\] admits every trial\)"):
        validate(compose_cfg("+experiment=sweep", "study.target_clip=[0.2,1.5]"))


def test_the_band_is_one_key():
    cfg = compose_cfg("+experiment=sweep", "study.target_clip=[0.02,0.1]")
    assert cfg.study.target_clip == [0.02, 0.1] and compose_cfg().study.target_clip == [0.01, 0.2]


@pytest.mark.parametrize("flag", [[], ["-m"]])
@pytest.mark.parametrize("key", ["hydra.run.dir", "hydra.sweep.dir"])
def test_an_output_folder_hydra_cannot_create_is_one_line_before_anything_runs(tmp_path, capsys, key, flag):
    """Hydra creates its folder before the job and raised an OSError traceback there (exit 1)."""
    from sweep.__main__ import precheck

    (tmp_path / "blocker").write_text("a file where a folder should be")
    with pytest.raises(SystemExit) as e:
        precheck([*flag, "+experiment=train", f"{key}={tmp_path}/blocker/out"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {key}={tmp_path}/blocker/out: {tmp_path}/blocker is a file, so Hydra cannot create its folder "
        f"there: pass a writable {key}"
    )
    assert list(tmp_path.iterdir()) == [tmp_path / "blocker"]
    precheck(["+experiment=train", f"{key}={tmp_path}/new/out"])  # a folder it can create passes


@pytest.mark.parametrize("where", ["blocker/spike.png", "folder"])
def test_a_spike_figure_it_cannot_write_is_refused_before_the_replay(tmp_path, where):
    """The copy came after the whole replay (minutes) and ended in an OSError traceback."""
    (tmp_path / "blocker").write_text("a file where a folder should be")
    (tmp_path / "folder").mkdir()
    out = tmp_path / where
    with pytest.raises(UserError) as e:
        validate(compose_cfg("+experiment=spike", f"spike.figure_out={out}"))
    what = f"{tmp_path}/blocker is a file" if where.startswith("blocker") else f"{out} is a folder"
    assert str(e.value) == f"spike.figure_out={out}: {what}: pass a file path in a writable folder"
    validate(compose_cfg("+experiment=spike", f"spike.figure_out={tmp_path}/new/spike.png"))  # creatable: fine


def test_an_unknown_clip_mode_names_the_override_to_pass_not_a_folder():
    with pytest.raises(UserError) as e:
        validate(compose_cfg("+experiment=train", "clip.mode=nrom"))
    assert str(e.value).endswith(": pass clip=MODE, e.g. clip=norm (docs/clipping.md)")


@pytest.mark.parametrize(
    "stages",
    [
        "[[0,2.0],[1000,1.0]]",
        pytest.param("[[0,2],[1000,1]]", marks=pytest.mark.slow),  # the other spellings are slow
        pytest.param("[[0.0,2.0],[1000.0,1.0]]", marks=pytest.mark.slow),
    ],
)
def test_staged_takes_integer_start_steps_as_docs_write_them(stages):
    """docs/clipping.md's ``clip.stages=[[0,2.0],[1000,1.0]]`` (and the refusal's own fix,
    ``clip.stages=[[0,1.0]]``): OmegaConf refused the int 0 inside list[list[float]], so the
    documented override failed to compose. The policy clips at 2 up to step 999 and at 1 from 1000."""
    cfg = compose_cfg("+experiment=train", "clip=staged", f"clip.stages={stages}")
    validate(cfg)
    assert cfg.clip.stages == [[0.0, 2.0], [1000.0, 1.0]]  # one spelling, logged alike
    policy = build_clip_policy(cfg)
    assert [policy.max_norm_at(s) for s in (1, 999, 1000, 5000)] == [2.0, 2.0, 1.0, 1.0]
    assert compose_cfg("+experiment=train", "clip=staged", "clip.stages=[[0,1.0]]").clip.stages == [[0.0, 1.0]]


#: A Hydra multirun each: the first and the last stay in the fast subset, the rest are slow.
@pytest.mark.parametrize(
    ("run", "sweep", "single"),
    [
        ("train", "clip.maxnorm=0.5,1.0", "clip.maxnorm=0.5"),
        pytest.param("train", "clip=norm,Norm", "clip=Norm", marks=pytest.mark.slow),
        pytest.param("train", "clip.max_norm=1,abc", "clip.max_norm=abc", marks=pytest.mark.slow),
        pytest.param("sweep", "study.target_clip_low=0.1,0.2", "study.target_clip_low=0.1", marks=pytest.mark.slow),
        ("calibrate", "clip.max_norm=1.0,2.0", "clip.max_norm=1.0"),
    ],
)
def test_a_multirun_mistake_is_the_single_runs_one_line(capsys, run, sweep, single):
    """``clipamp -m`` (docs/experiments.md) skipped the check: Hydra printed its multi-line error (exit 1) and
    suggested ``+clip.maxnorm=…``, or a calibrate job ran with the clip override ignored. Each value of a
    sweep now gets the line a single run with that value gets."""
    from sweep.__main__ import precheck

    lines = []
    for argv in (["-m", f"+experiment={run}", sweep], [f"+experiment={run}", single]):
        with pytest.raises(SystemExit) as e:
            precheck(argv)
        assert e.value.code == 2
        lines.append(capsys.readouterr().err.strip())
    assert lines[0] == lines[1] and lines[0].startswith("error: ") and "\n" not in lines[0]


def test_a_multirun_without_a_mistake_passes_the_check(capsys):
    from sweep.__main__ import precheck

    precheck(["--multirun", "+experiment=train", "clip.max_norm=0.5,1.0", "seed=range(0,3)", "clip=glob(n*)"])
    with pytest.raises(SystemExit):
        precheck(["-m", "experiment=train", "seed=1,2"])
    assert capsys.readouterr().err.startswith("error: experiment=train needs a +: pass +experiment=train")


def test_a_negative_eval_every_is_refused():
    """eval_every=-1 passed and, as step % -1 == 0, evaluated after every step (measured: eval_loss at
    steps 1-5 of a 5-step run, where 0 gives step 5 only and 2 gives 2, 4, 5)."""
    for ok in ("0", "2"):
        validate(compose_cfg("+experiment=train", f"eval_every={ok}"))
    with pytest.raises(UserError) as e:
        validate(compose_cfg("+experiment=train", "eval_every=-1"))
    assert str(e.value) == "eval_every=-1 must be >= 0 (0: evaluate at the end only)"


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_step_the_run_never_reaches_is_refused(fault):
    """faults.nan_grad=[-3] (or 0, or past ``steps``) passed and the run injected nothing: a fault
    test that passes because its fault never fired."""
    validate(compose_cfg("+experiment=train", "steps=50", f"faults.{fault}=[1,50]"))
    for steps in ([-3], [0], [5, 51]):
        with pytest.raises(UserError) as e:
            validate(compose_cfg("+experiment=train", "steps=50", f"faults.{fault}={steps}".replace(" ", "")))
        bad = next(s for s in steps if not 1 <= s <= 50)
        assert str(e.value) == f"faults.{fault}={steps}: step {bad} never comes: pass steps from 1 to steps=50"


@pytest.mark.slow  # a CLI run
def test_a_negative_forensics_top_k_is_one_line_before_a_run_opens(tmp_path):
    """forensics.top_k=-1 passed validation, opened a run, then StepForensics raised: a traceback, exit 1,
    and a FAILED MLflow run with an empty steps.csv."""
    res = run_cli("+experiment=train", "steps=2", "progress=false", "forensics.top_k=-1", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert (
        res.stderr.strip()
        == "error: forensics.top_k=-1 must be >= 0 (0: no top_grad_params column): pass e.g. forensics.top_k=3"
    )
    assert not (tmp_path / "mlruns").exists()  # refused before the store opened


@pytest.mark.parametrize("override", ["study.heartbeat_interval=0", "study.grace_period=-1"])
def test_a_heartbeat_setting_out_of_range_is_named_by_its_key(override):
    """Both went to Optuna's RDBStorage, whose ValueError came back as "study.storage=sqlite:///… cannot be
    opened …: pass study.storage=…": the wrong key blamed, the wrong fix given."""
    key, value = override.split("=")
    with pytest.raises(UserError) as e:
        validate(compose_cfg("+experiment=sweep", override))
    assert str(e.value) == f"{key}={value} must be >= 1"
    validate(compose_cfg("+experiment=sweep", f"{key}=1"))


@pytest.mark.parametrize(
    ("study", "override"),
    [
        ("study=entangle", "study.dtypes=[fp16]"),
        ("study=entangle", "study.n_trials=3"),
        ("study=entangle", "study.sampler=random"),
        ("study=entangle", "study.anchor=null"),
        ("study=pareto", "study.lr_factors=[1.0]"),
        ("study=constrained", "study.seeds=3"),
        ("study=pareto", "study.entangle_quantiles=[p50]"),
    ],
)
def test_a_study_key_the_sweeps_mode_would_ignore_is_refused(study, override, capsys):
    """``study=entangle study.dtypes=[fp16]`` ran the LR check in bf16 (amp.dtype), ``study=pareto
    study.seeds=3`` ran one seed per trial, without a word: each key is read by one mode only."""
    from sweep.__main__ import precheck
    from sweep.config.schema import StudyConfig
    from sweep.config.study_keys import ENTANGLE_KEYS, OPTUNA_KEYS

    with pytest.raises(SystemExit) as e:
        precheck(["+experiment=sweep", study, override])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {override}: ") and ("would ignore" in err or "would be ignored" in err)
    other = "study=pareto" if study == "study=entangle" else "study=entangle"
    precheck(["+experiment=sweep", other, override])  # the mode that reads it: accepted
    fields = {f"study.{f}" for f in StudyConfig.__dataclass_fields__}
    assert set(ENTANGLE_KEYS) | set(OPTUNA_KEYS) <= fields and not set(ENTANGLE_KEYS) & set(OPTUNA_KEYS)


@pytest.mark.parametrize(
    ("args", "override", "fix"),
    [
        ([], "study.max_norm_low=0.1", "study.anchor=null"),
        (["study=constrained"], "study.max_norm_high=5.0", "study.anchor=null"),
        (["study.anchor=null"], "study.anchor_low=0.25", "study.anchor=window"),
    ],
)
def test_a_range_key_of_the_search_space_not_used_is_refused(args, override, fix, capsys):
    """``+experiment=sweep study.max_norm_low=0.1 study.max_norm_high=5.0`` (the docs' range without its
    ``study.anchor=null``) searched the anchor window's range without a word; ``study.anchor_low`` under
    ``study.anchor=null`` likewise changed nothing. The study's range is the one the sweep really searched."""
    from sweep.__main__ import precheck
    from sweep.config.schema import StudyConfig
    from sweep.config.study_keys import ANCHORED_RANGE_KEYS, FIXED_RANGE_KEYS
    from sweep.experiments.study.space import max_norm_range

    with pytest.raises(SystemExit) as e:
        precheck(["+experiment=sweep", *args, override])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {override}: ") and "would be ignored" in err and fix in err
    assert "\n" not in err
    cfg = compose_cfg("+experiment=sweep", *args, override)
    anchor = {"p50": 1.0, "p90": 2.0, "p95": 3.0, "p99": 4.0} if cfg.study.anchor else None
    assert max_norm_range(cfg, anchor) == max_norm_range(compose_cfg("+experiment=sweep", *args), anchor)  # unread
    reads_it = [a for a in args if not a.startswith("study.anchor=")] + [fix]
    precheck(["+experiment=sweep", *reads_it, override])  # with the search space that reads it: accepted
    assert set(FIXED_RANGE_KEYS) | set(ANCHORED_RANGE_KEYS) <= {f"study.{f}" for f in StudyConfig.__dataclass_fields__}


@pytest.mark.parametrize(
    ("argv", "given", "dtype"),
    [
        (["+experiment=train", "amp.init_scale=1024"], "amp.init_scale=1024", "bf16"),
        (["+experiment=calibrate", "amp=fp32", "amp.hysteresis=2"], "amp.hysteresis=2", "fp32"),
        (["-m", "+experiment=train", "amp.growth_interval=20", "seed=0,1"], "amp.growth_interval=20", "bf16"),
    ],
)
def test_a_loss_scaler_key_of_a_run_that_scales_no_loss_is_refused(argv, given, dtype, capsys):
    """``+experiment=train amp.init_scale=1024`` trained in bf16 without a word: the engine's scaler is off
    outside fp16, so the key changed nothing. Kept where an fp16 run reads it: fp16, a sweep or a spike
    replay (fp16 beside bf16), a multirun over the dtype."""
    from sweep.__main__ import precheck
    from sweep.run.build import build_state
    from sweep.tasks.build import build_task

    cfg = compose_cfg(*[a for a in argv if a != "-m" and "," not in a], "model=linear", "data=synthetic")
    state = build_state(cfg, build_task(cfg.model, cfg.data, seed=0).model, torch.nn.functional.mse_loss)
    assert cfg.amp.dtype == dtype and not state.scaler.is_enabled()  # nothing reads the key
    with pytest.raises(SystemExit) as e:
        precheck(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {given}: the loss scaler runs under amp.dtype=fp16 only ({dtype} scales no loss), so this "
        f"{dtype} run would ignore it: drop it, or pass amp.dtype=fp16"
    )
    precheck([*argv, "amp.dtype=fp16"])
    precheck(["+experiment=sweep", given])
    precheck(["+experiment=spike", given])
    precheck(["-m", "+experiment=train", given, "amp.dtype=fp16,bf16"])


@pytest.mark.parametrize(("typed", "kept"), [("true", "true"), ("True", "true"), ("false", None), ("last", "last")])
def test_resume_is_what_the_user_typed_and_false_means_no_resume(typed, kept):
    """Hydra reads resume=true/false as booleans, which the str field kept as "True"/"False": a line echoed
    ``resume=True``, and ``resume=false`` was looked up as a run id named 'False' (a one-line error)."""
    assert compose_cfg("+experiment=train", f"resume={typed}").resume == kept
    run_id = "0123456789abcdef0123456789abcdef"
    assert compose_cfg("+experiment=train", f"resume={run_id}").resume == run_id
    validate(compose_cfg("+experiment=spike", "resume=false"))  # not a resume: the replay runs


@pytest.mark.parametrize(
    ("argv", "pair"),
    [
        (["-m", "--cfg", "job", "+experiment=train"], "-m and --cfg"),
        (["--multirun", "-c", "job", "+experiment=train", "seed=1,2"], "-m and --cfg"),
        (["--info", "-m", "+experiment=train"], "-m and --info"),
        (["-m", "+experiment=train", "-sc"], "-m and --shell-completion"),
        (["--run", "--cfg=job", "+experiment=train"], "--run and --cfg"),
    ],
)
def test_two_of_hydras_commands_are_one_line_not_its_traceback(argv, pair, capsys):
    """``-m --cfg job`` reached Hydra, whose own check raised ``ValueError`` (a traceback, exit 1)."""
    from sweep.__main__ import precheck

    with pytest.raises(SystemExit) as e:
        precheck(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: {pair} cannot be combined") and err.count("\n") == 1


def test_a_mistake_under_cfg_job_is_the_runs_one_line(capsys):
    """``--cfg job`` (docs/experiments.md) skipped the check: a misspelt key or choice was Hydra's multi-line
    error with its search path, exit 1. It is now the line the run itself gives."""
    from sweep.__main__ import precheck

    for typo in ("clip=nrom", "clip.maxnorm=1"):
        lines = []
        for flags in ([], ["--cfg", "job"], ["-c", "all", "--resolve"], ["--cfg=job", "-p", "clip"]):
            with pytest.raises(SystemExit) as e:
                precheck(["+experiment=train", *flags, typo])
            assert e.value.code == 2
            lines.append(capsys.readouterr().err)
        assert len(set(lines)) == 1 and lines[0].startswith("error: ") and lines[0].count("\n") == 1
    precheck(["+experiment=train", "--cfg", "job", "steps=3", "-p", "clip"])  # no mistake: Hydra prints it
    precheck(["-m", "--help", "+experiment=train"])  # --help is printed whatever else is given
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("device", ["gpu", "cuda0", "GPU:0"])
def test_a_device_torch_has_no_name_for_is_named_so_with_the_names_to_pass(device):
    """``device=gpu`` said 'is not available here (torch sees no such device); use device=cpu': on a machine
    with a GPU that sends the user to the CPU for a typo. It now says the name is not torch's and which are."""
    import torch

    with pytest.raises(RuntimeError):
        torch.device(device)  # the reference: torch itself has no such device type
    with pytest.raises(UserError) as e:
        validate(compose_cfg("+experiment=train", f"device={device}"))
    assert str(e.value) == (
        f"device={device!r} is not a device name torch knows: pass device=cpu or device=cuda (cuda:N for one GPU)"
    )


def test_two_experiments_are_one_line_naming_the_multirun_that_runs_both(capsys):
    """``+experiment=train +experiment=calibrate`` gave Hydra's "To override a value use 'override experiment:
    calibrate'", a defaults-list line with no command-line form. The line now names the ``-m`` that runs each,
    and that command passes the check."""
    from sweep.__main__ import precheck

    with pytest.raises(SystemExit) as e:
        precheck(["+experiment=train", "+experiment=calibrate"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: +experiment= is given more than once: a run takes one +experiment=NAME; for one run per NAME pass "
        "-m +experiment=A,B\n"
    )
    precheck(["-m", "+experiment=train,calibrate", "steps=40"])  # the suggested form: each job composes
    assert capsys.readouterr().err == ""
