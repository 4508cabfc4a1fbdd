"""``validate(cfg)``: the meaning checks after composition, one entry point dispatching on ``cfg.run``.

Every check raises ``UserError`` with one line naming the value, what is allowed and the fix.
Choices are checked generically from the schema (``choice`` fields); ``check_common`` holds the
rest of what every run needs, ``check_study`` / ``check_spike`` what their experiment adds.
Ranges the engine checks itself (the policy of ``clip.mode`` for ``clip.*``, ``CalibratedClip`` for
``calibrate.*``, ``HysteresisScaler`` for the scaler's ``amp.*``) are not restated: ``engine_check``
builds the object and turns its ``ValueError`` into a line named by config key.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

from clipamp_engine.clip import CLIP_MODES, clip_mode_options, make_clip_policy
from clipamp_engine.clip.calibrated import RECOMMENDED, CalibratedClip
from clipamp_engine.scaling import HysteresisScaler
from clipamp_engine.step import DTYPES
from sweep.config.engine_check import engine_check
from sweep.config.keys import given
from sweep.config.schema import CALIBRATED, FAULTS, RUNS, CalibrateConfig, ClipConfig, Config, forensics_on
from sweep.config.spelling import APP_SPELLING
from sweep.config.validate_spike import check_spike
from sweep.distributed.launch import forensics_refusal
from sweep.errors import UserError

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def validate(cfg: Config) -> None:
    """All checks for ``cfg.run``: choices, the common ones, then the experiment's own."""
    if cfg.run is None:
        raise UserError(f"no experiment chosen: add +experiment=NAME with NAME one of {', '.join(RUNS)}")
    check_choices(cfg)
    check_common(cfg)
    {"sweep": check_study, "spike": check_spike}.get(cfg.run, lambda cfg: None)(cfg)


def check_choices(node: Any, prefix: str = "") -> None:
    """Every ``choice`` field of ``node`` (recursively) holds one of its allowed values."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{prefix}{f.name}.")
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            fix = f.metadata["fix"]
            raise UserError(
                f"{prefix}{f.name}={value!r} is not one of {', '.join(f.metadata['choices'])}"
                + (f": {fix}" if fix else "")
            )


def check_common(cfg: Config) -> None:
    """Ranges every run needs: steps, accumulation, LR, clip threshold, calibration, device, tracking."""
    if cfg.steps < 1:
        raise UserError(f"steps={cfg.steps} must be >= 1")
    if cfg.accumulation_steps < 1:
        raise UserError(f"accumulation_steps={cfg.accumulation_steps} must be >= 1")
    if cfg.data.batch_size < cfg.accumulation_steps:
        raise UserError(f"data.batch_size={cfg.data.batch_size} must be >= accumulation_steps={cfg.accumulation_steps}")
    if not cfg.optim.lr > 0:
        raise UserError(f"optim.lr={cfg.optim.lr} must be > 0")
    check_clip(cfg)
    check_calibrate(cfg)
    check_numbers(cfg)
    if cfg.eval_every < 0:
        raise UserError(f"eval_every={cfg.eval_every} must be >= 0 (0: evaluate at the end only)")
    for name in FAULTS:  # a fault step outside the run never fires: the check it was meant for passes unseen
        steps = list(getattr(cfg.faults, name))
        if off := [s for s in steps if not 1 <= s <= cfg.steps]:
            raise UserError(f"faults.{name}={steps}: step {off[0]} never comes: pass steps from 1 to steps={cfg.steps}")
    if cfg.checkpoint_every < 0:
        raise UserError(f"checkpoint_every={cfg.checkpoint_every} must be >= 0 (0: only on SIGINT/SIGTERM)")
    if cfg.device != "cpu" and (why := _device_refusal(cfg.device)):
        raise UserError(f"device={cfg.device!r} {why}")
    if cfg.amp.dtype == "fp16" and not _fp16_autocast_ok(cfg.device):
        raise UserError(f"amp.dtype=fp16 is not supported on device={cfg.device!r}; use amp.dtype=bf16 or fp32")
    if cfg.tracking.flush_every < 1:
        raise UserError(f"tracking.flush_every={cfg.tracking.flush_every} must be >= 1")
    if not cfg.tracking.reconnect_s >= 0:
        raise UserError(f"tracking.reconnect_s={cfg.tracking.reconnect_s} must be >= 0 (seconds)")
    if not cfg.dist.timeout_s > 0:
        raise UserError(f"dist.timeout_s={cfg.dist.timeout_s} must be > 0 (seconds)")


#: (key, test, what is allowed, an example): the numeric ranges of optim, amp, model and forensics.
_RANGES = (
    ("optim.min_lr_ratio", lambda v: 0.0 <= v <= 1.0, "in [0, 1] (the LR decays to min_lr_ratio·lr)", "0.1"),
    ("optim.weight_decay", lambda v: v >= 0.0, ">= 0", "0.1"),
    ("optim.momentum", lambda v: 0.0 <= v < 1.0, "in [0, 1)", "0.9"),
    ("optim.warmup_steps", lambda v: v >= 0, ">= 0", "20"),
    ("amp.init_scale", lambda v: v > 0.0, "> 0", "65536"),
    ("amp.growth_factor", lambda v: v > 1.0, "> 1", "2.0"),
    ("amp.backoff_factor", lambda v: 0.0 < v < 1.0, "in (0, 1)", "0.5"),
    ("amp.growth_interval", lambda v: v >= 1, ">= 1", "2000"),
    ("model.dropout", lambda v: 0.0 <= v < 1.0, "in [0, 1)", "0.1"),
    ("forensics.top_k", lambda v: v >= 0, ">= 0 (0: no top_grad_params column)", "3"),
)


def check_numbers(cfg: Config) -> None:
    """Optimizer, scaler and model numbers in their ranges (NaN fails every test)."""
    for key, ok, allowed, example in _RANGES:
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        if not ok(value):
            raise UserError(f"{key}={value} must be {allowed}: pass e.g. {key}={example}")
    betas = cfg.optim.betas
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise UserError(f"optim.betas={list(betas)} must be two numbers in [0, 1): pass e.g. optim.betas=[0.9,0.95]")
    a = cfg.amp  # the loss scaler checks its own ranges (hysteresis, min_scale <= init_scale <= max_scale)
    scaler = {k: getattr(a, k) for k in _options(HysteresisScaler) if hasattr(a, k)}
    engine_check(lambda: HysteresisScaler("cpu", enabled=False, **scaler), "amp", a, scaler)
    if cfg.progress_every < 1:
        raise UserError(f"progress_every={cfg.progress_every} must be >= 1 (steps between plain progress lines)")
    m = cfg.model
    for key in ("d_model", "n_layer", "n_head", "block_size", "hidden", "in_features", "out_features"):
        if getattr(m, key) < 1:
            raise UserError(f"model.{key}={getattr(m, key)} must be >= 1")


def clip_options(cfg: Config) -> dict[str, Any]:
    """The options of ``cfg.clip.mode`` that the config sets; options of other modes are refused.
    ``clip=calibrated`` reads every option from ``calibrate.*`` (a ``clip.*`` value is refused, naming
    the ``calibrate`` key to pass instead)."""
    clip = cfg.clip
    try:
        accepted = clip_mode_options(clip.mode)
    except ValueError:
        raise UserError(f"clip={clip.mode!r} is not one of {', '.join(CLIP_MODES)}") from None
    given = {f.name: getattr(clip, f.name) for f in dataclasses.fields(clip) if f.name != "mode"}
    given = {k: v for k, v in given.items() if v is not None}
    if clip.mode == "calibrated":
        if given:
            key, value = next(iter(given.items()))
            fix = f"pass calibrate.{key}={value} instead" if key in accepted else f"drop clip.{key}"
            raise UserError(f"clip.{key}={value}: clip=calibrated reads its options from calibrate.*; {fix}")
        return {**dataclasses.asdict(cfg.calibrate), "start": calibrate_start(cfg.calibrate.start)}
    foreign = sorted(set(given) - set(accepted))
    if foreign:
        # clip.quantile is clip=quantile's own option, so it is not a RENAMED key: a calibrate run
        # that passes it meant calibrate.quantile
        meant = [k for k in foreign if cfg.run == "calibrate" and k in CALIBRATED]
        hint = (
            f"; +experiment=calibrate reads calibrate.*: pass calibrate.{meant[0]}={given[meant[0]]}" if meant else ""
        )
        raise UserError(
            f"clip={clip.mode} does not take {', '.join(f'clip.{k}' for k in foreign)}; "
            f"its options are {', '.join(accepted) or 'none'}{hint}"
        )
    return given


#: Modes whose options are checked against the model (parameter groups, names): built with it, at run start.
_NEEDS_MODEL = ("per_group",)


def check_clip(cfg: Config) -> None:
    """``clip.*`` as the engine's policy of ``clip.mode`` takes it (it checks the ranges; options of
    another mode refused), before a run opens. ``clip=calibrated`` is built from ``calibrate.*`` by
    ``check_calibrate``."""
    options, mode = clip_options(cfg), cfg.clip.mode
    if cfg.run == "calibrate":
        _refuse_clip_in_calibrate(cfg)
    if mode == "calibrated" or mode in _NEEDS_MODEL:
        return
    build = lambda: make_clip_policy(mode, total_steps=cfg.steps, **options)  # noqa: E731
    engine_check(build, "clip", cfg.clip, options, defaults=clip_mode_options(mode))


def _refuse_clip_in_calibrate(cfg: Config) -> None:
    """A calibrate run trains at its calibrated τ: a ``clip=`` group or ``clip.*`` key would be ignored."""
    default = ClipConfig(mode="norm", **clip_mode_options("norm"))  # conf/clip/norm.yaml, the config's default
    if cfg.clip.mode == "calibrated" or cfg.clip == default:
        return
    changed = [f.name for f in dataclasses.fields(ClipConfig) if getattr(cfg.clip, f.name) != getattr(default, f.name)]
    given = f"clip={cfg.clip.mode}" if "mode" in changed else f"clip.{changed[0]}={getattr(cfg.clip, changed[0])}"
    raise _ignored_in_calibrate(given)


def refuse_clip_overrides(run: str | None, overrides: list[str]) -> None:
    """The command line's ``clip=…`` / ``clip.*=…`` in a calibrate run, even one that repeats a default
    (``clip=norm``, ``clip.max_norm=1``), which ``check_clip`` cannot tell from no override at all;
    ``clip=calibrated`` names what the run trains with."""
    if run != "calibrate":
        return
    for text, key, value in given(overrides):
        if key.removeprefix("clip.") in _CALIBRATE_KEYS:
            continue  # clip.quantile=…: check_clip names the calibrate.* key it meant
        if (key == "clip" and value != "calibrated") or key.startswith("clip."):
            raise _ignored_in_calibrate(text)


_CALIBRATE_KEYS = {f.name for f in dataclasses.fields(CalibrateConfig)}


def _ignored_in_calibrate(given: str) -> UserError:
    return UserError(
        f"{given}: +experiment=calibrate trains at its calibrated τ (clip=calibrated, whose options are "
        f"calibrate.*), so the clip group would be ignored: drop it, or run +experiment=train {given}"
    )


#: The ``study.*`` keys only ``study=constrained`` reads: its pruning.
PRUNING_KEYS = ("study.pruner", "study.prune_warmup", "study.prune_below_after", "study.report_every")


def refuse_pruning_overrides(run: str | None, mode: str, overrides: list[str]) -> None:
    """The command line's pruning keys in a sweep whose study prunes nothing (``study=pareto``: a
    multi-objective study cannot report; ``study=entangle``: a fixed grid), which would be ignored."""
    if run != "sweep" or mode == "constrained":
        return
    for text, key, _ in given(overrides):
        if key in PRUNING_KEYS and text != "study.pruner=none":  # none: what it does
            why = "a multi-objective study cannot prune" if mode == "pareto" else "it runs every cell of its grid"
            raise UserError(
                f"{text}: study={mode} prunes no trial ({why}), so it would be ignored: drop it, or pass "
                "study=constrained, whose trials are pruned"
            )


def check_calibrate(cfg: Config) -> None:
    """``calibrate.*`` as the engine's ``CalibratedClip`` takes it (it checks the ranges), and a window
    that fits in a calibrate run."""
    c = cfg.calibrate
    c.start = calibrate_start(c.start)
    options = dataclasses.asdict(c)
    ours = {k: list(v) if isinstance(v, tuple) else v for k, v in RECOMMENDED.items()}  # +experiment=calibrate's
    defaults = ours if cfg.run == "calibrate" else None  # the fix a message suggests: the run's own default
    engine_check(
        lambda: CalibratedClip(**options, total_steps=cfg.steps, spelling=APP_SPELLING),
        "calibrate",
        c,
        options,
        defaults,
    )
    skip = c.start if isinstance(c.start, int) else 0  # auto starts at step 1 in a run too short to wait
    if cfg.run == "calibrate" and skip + c.window > cfg.steps and not cfg.resume:  # a resume: resume_length's
        start = f"calibrate.start={skip} + " if skip else ""
        lower = "calibrate.window or calibrate.start" if skip else "calibrate.window"
        raise UserError(
            f"{start}calibrate.window={c.window} is larger than steps={cfg.steps}: lower {lower}, or raise steps"
        )


def calibrate_start(value: Any) -> Any:
    """``calibrate.start`` given as digits (``"100"``) as the step count; anything else as given."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def _options(cls: type) -> list[str]:
    return [n for n, p in inspect.signature(cls).parameters.items() if p.kind is not p.VAR_KEYWORD]


def check_study(cfg: Config) -> None:
    """``+experiment=sweep``: no ``resume=``, the study's ranges, dtypes, anchor and band."""
    s = cfg.study
    if cfg.resume:  # its trials would each start afresh, resume= silently dropped
        how = (
            "the LR check (study=entangle) is not resumable: re-run the command without resume= to start it again"
            if s.mode == "entangle"
            else "a sweep resumes its study when the same command is run again (a trial a signal stopped is "
            "recovered): re-run the command without resume="
        )
        raise UserError(f"resume={cfg.resume}: {how}")
    if not s.dtypes or len(set(s.dtypes)) != len(s.dtypes) or any(d not in DTYPES for d in s.dtypes):
        raise UserError(
            f"study.dtypes={list(s.dtypes)} must be distinct values of {', '.join(DTYPES)}, "
            f"e.g. study.dtypes=[fp16,bf16]"
        )
    if s.n_trials < len(s.dtypes):
        raise UserError(
            f"study.n_trials={s.n_trials} must be >= {len(s.dtypes)} (one trial per dtype in "
            f"study.dtypes={list(s.dtypes)} comes first in every sweep)"
        )
    for name in ("max_norm", "anchor"):
        low, high = getattr(s, f"{name}_low"), getattr(s, f"{name}_high")
        if not 0 < low < high:
            raise UserError(f"study.{name}_low={low} and study.{name}_high={high} must satisfy 0 < low < high")
    if s.anchor is not None and s.anchor != "window" and not _RUN_ID.match(s.anchor):
        raise UserError(
            f"study.anchor={s.anchor!r} is not 'window' or an MLflow run id (32 hex digits): pass "
            f"study.anchor=window, the id of a calibrate run, or null for the max_norm_low/high range"
        )
    band = list(s.target_clip)
    if len(band) != 2 or not 0.0 <= band[0] <= band[1] <= 1.0:
        raise UserError(
            f"study.target_clip={band} must be [low, high] with 0 <= low <= high <= 1 (a constraint on each "
            "trial's clipping ratio: [0,1] admits every trial): pass e.g. study.target_clip=[0.01,0.2]"
        )
    if not 0.0 <= s.prune_warmup < 1.0:
        raise UserError(f"study.prune_warmup={s.prune_warmup} must be in [0, 1)")
    if s.prune_below_after is not None and not 0.0 <= s.prune_below_after < 1.0:
        raise UserError(
            f"study.prune_below_after={s.prune_below_after} must be in [0, 1) or null (no below-band pruning)"
        )
    for key, low in (
        ("report_every", 1),
        ("threads", 0),
        ("startup_trials", 0),
        ("heartbeat_interval", 1),
        ("grace_period", 1),
    ):
        if getattr(s, key) < low:
            raise UserError(
                f"study.{key}={getattr(s, key)} must be >= {low}"
                + (" (0: torch's default)" if key == "threads" else "")
            )
    check_nproc_per_trial(cfg)
    if cfg.clip.mode != "norm":
        raise UserError(
            f"clip={cfg.clip.mode}: the sweep tunes the global-norm threshold clip.max_norm; pass clip=norm"
        )


def check_nproc_per_trial(cfg: Config) -> None:
    """``study.nproc_per_trial=N``: trials as torchrun jobs, which the sweep process cannot prune."""
    s, n = cfg.study, cfg.study.nproc_per_trial
    if n < 1:
        raise UserError(f"study.nproc_per_trial={n} must be >= 1 (1: each trial in the sweep process)")
    if n == 1:
        return
    if s.mode == "entangle":
        raise UserError(
            f"study.nproc_per_trial={n}: study=entangle runs its grid in the sweep process; drop study.nproc_per_trial"
        )
    if s.mode == "constrained" and s.pruner != "none":
        raise UserError(
            f"study.nproc_per_trial={n}: a trial runs as a torchrun job whose steps the sweep process "
            f"does not see, so study.pruner={s.pruner} cannot stop it; pass study.pruner=none "
            "(or study.nproc_per_trial=1)"
        )
    if cfg.data.batch_size % n:
        raise UserError(
            f"data.batch_size={cfg.data.batch_size} does not split over study.nproc_per_trial={n} "
            f"ranks: use a multiple of {n}"
        )
    if cfg.dist.strategy == "none":
        raise UserError(f"study.nproc_per_trial={n} needs dist.strategy=auto, ddp or fsdp2 for its trials")
    if refusal := forensics_refusal(cfg.dist.strategy, forensics_on(cfg.forensics)):
        raise UserError(f"study.nproc_per_trial={n} with dist.strategy={cfg.dist.strategy}: {refusal}")


def _device_refusal(device: str) -> str | None:
    """Why ``device`` cannot run: not a torch device name (``gpu``), or one torch does not see; None if it can."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        return "is not a device name torch knows: pass device=cpu or device=cuda (cuda:N for one GPU)"
    mod = getattr(torch, dev.type, None)
    if mod is not None and hasattr(mod, "is_available") and mod.is_available():
        return None
    return "is not available here (torch sees no such device); use device=cpu"


def _fp16_autocast_ok(device: str) -> bool:
    import torch

    return torch.amp.is_autocast_available(torch.device(device).type)
