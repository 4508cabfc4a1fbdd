"""The app's structured-config schema (Hydra/OmegaConf) and its semantic checks.

The schema rejects unknown keys and wrong types while Hydra composes ``conf/``; ``validate``
then checks meaning (ranges, allowed sets, files) and raises ``UserError`` with one line naming
the value, what is allowed and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from clipamp_engine import DTYPES

from .errors import UserError
from .faults import FaultsConfig
from .spike_config import SpikeConfig
from .study_config import StudyConfig
from .tasks.config import DataConfig, ModelConfig

RUNS = ("calibrate", "train", "sweep", "spike")
SCHEDULES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "adam", "sgd")


@dataclass
class OptimConfig:
    """Optimizer and LR schedule (warmup then cosine/linear decay to ``min_lr_ratio``·lr)."""

    name: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    momentum: float = 0.9  # sgd only
    warmup_steps: int = 20
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1


@dataclass
class AmpConfig:
    """Autocast dtype and the loss scaler (fp16 only)."""

    dtype: str = "bf16"
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1  # N > 1: DeepSpeed's delayed_shift (N-1 overflows absorbed before backing off)
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0  # floor (an alarm when reached)
    max_scale: float = 16777216.0  # cap (2**24)


@dataclass
class ForensicsConfig:
    """Optional per-step columns (each costs a little; all off by default)."""

    update_norm: bool = False  # ‖Δθ‖ of the step (one copy of the trainable params)
    param_norm: bool = False
    top_k: int = 0  # names of the top-k parameters by gradient norm
    zero_grads: bool = False  # number of parameter tensors with an all-zero gradient


@dataclass
class ClipConfig:
    """``clip=MODE`` and the options of every mode (``clipamp_engine.clip_mode_options``).

    Each ``conf/clip/MODE.yaml`` sets its mode's options; the others stay null. An option set
    for a mode that does not take it is refused.
    """

    mode: str = "norm"
    max_norm: Optional[float] = None  # norm: τ; zscore: optional ceiling
    clip_value: Optional[float] = None  # value
    stages: Optional[List[List[float]]] = None  # staged: [[start_step, τ], ...]
    max_norms: Optional[List[float]] = None  # per_group: τ_j by optimizer param group
    patterns: Optional[Dict[str, float]] = None  # per_group: {name regex: τ_j}
    rest_max_norm: Optional[float] = None  # per_group: τ for params matching no pattern
    clip_factor: Optional[float] = None  # agc
    eps: Optional[float] = None  # agc, zscore
    exclude: Optional[List[str]] = None  # agc: name regexes left unclipped
    exclude_1d: Optional[bool] = None  # agc: leave biases / norm scales unclipped
    max_update_norm: Optional[float] = None  # update: ρ
    decoupled_weight_decay: Optional[bool] = None  # update: null = detect per group
    quantile: Optional[float] = None  # quantile (AutoClip)
    history: Optional[int] = None  # quantile
    include_current: Optional[bool] = None  # quantile: the paper's rule (true) or the autoclip package's (false)
    alpha: Optional[float] = None  # zscore (ZClip)
    z_thresh: Optional[float] = None  # zscore
    warmup_steps: Optional[int] = None  # zscore
    clip_option: Optional[str] = None  # zscore: adaptive_scaling | mean
    noise_multiplier: Optional[float] = None  # dpsgd: σ
    per_layer: Optional[bool] = None  # dpsgd: clip each parameter tensor to max_norm
    seed: Optional[int] = None  # dpsgd: noise RNG seed


@dataclass
class CalibrateConfig:
    """Calibration windows: measure pre-clip norms, then clip at τ = Quantile_q."""

    window: int = 100
    quantile: float = 0.95
    cap: Optional[float] = None  # clipping during a window: None = off, or a conservative cap
    every: int = 0  # repeat a window every N steps (0: once, at the start)
    candidates: List[float] = field(default_factory=lambda: [0.5, 1.0, 2.0, 5.0])


@dataclass
class TrackingConfig:
    """MLflow. ``uri`` null: ``$MLFLOW_TRACKING_URI`` if set, else the embedded sqlite store."""

    uri: Optional[str] = None
    experiment: str = "clipamp"
    flush_every: int = 50  # per-step metrics are sent in batches of this many steps
    plots: bool = True


@dataclass
class Config:
    run: Optional[str] = None  # set by +experiment=NAME
    steps: int = 300
    seed: int = 0
    device: str = "cpu"
    accumulation_steps: int = 1
    eval_every: int = 0  # 0: evaluate at the end only
    progress: bool = True
    checkpoint_every: int = 100  # also written at the step boundary after SIGINT/SIGTERM
    resume: Optional[str] = None  # true: the latest run of this name with a checkpoint; or a run id
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    study: StudyConfig = field(default_factory=StudyConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    forensics: ForensicsConfig = field(default_factory=ForensicsConfig)


def register() -> None:
    """Register the schema so ``conf/config.yaml`` can extend it (defaults: ``base_config``)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise UserError(f"{name}={value!r} is not one of {', '.join(map(str, allowed))}")


def validate(cfg: Config) -> None:
    """Semantic checks after composition; raise ``UserError`` naming value, allowed set and fix."""
    if cfg.run is None:
        raise UserError(f"no experiment chosen: add +experiment=NAME with NAME one of {', '.join(RUNS)}")
    _one_of("run", cfg.run, RUNS)
    if cfg.steps < 1:
        raise UserError(f"steps={cfg.steps} must be >= 1")
    if cfg.accumulation_steps < 1:
        raise UserError(f"accumulation_steps={cfg.accumulation_steps} must be >= 1")
    if cfg.data.batch_size < cfg.accumulation_steps:
        raise UserError(f"data.batch_size={cfg.data.batch_size} must be >= accumulation_steps={cfg.accumulation_steps}")
    _one_of("amp.dtype", cfg.amp.dtype, tuple(DTYPES))
    _one_of("optim.name", cfg.optim.name, OPTIMIZERS)
    _one_of("optim.schedule", cfg.optim.schedule, SCHEDULES)
    if not cfg.optim.lr > 0:
        raise UserError(f"optim.lr={cfg.optim.lr} must be > 0")
    if cfg.clip.max_norm is not None and not cfg.clip.max_norm > 0:
        raise UserError(f"clip.max_norm={cfg.clip.max_norm} must be > 0 (use clip=none to disable clipping)")
    c = cfg.calibrate
    if not 0.0 < c.quantile < 1.0:
        raise UserError(f"calibrate.quantile={c.quantile} must be in (0, 1), e.g. 0.95")
    if c.window < 2:
        raise UserError(f"calibrate.window={c.window} must be >= 2 steps")
    if cfg.run == "calibrate" and c.window > cfg.steps:
        raise UserError(f"calibrate.window={c.window} is larger than steps={cfg.steps}: "
                        f"lower calibrate.window or raise steps")
    if c.cap is not None and not c.cap > 0:
        raise UserError(f"calibrate.cap={c.cap} must be > 0 or null (no clipping during the window)")
    if c.every < 0 or (c.every and c.every < c.window):
        raise UserError(f"calibrate.every={c.every} must be 0 (one window) or >= calibrate.window={c.window}")
    if cfg.checkpoint_every < 0:
        raise UserError(f"checkpoint_every={cfg.checkpoint_every} must be >= 0 (0: only on SIGINT/SIGTERM)")
    if cfg.device != "cpu" and not _device_available(cfg.device):
        raise UserError(f"device={cfg.device!r} is not available on this machine; use device=cpu")
    if cfg.amp.dtype == "fp16" and not _fp16_autocast_ok(cfg.device):
        raise UserError(f"amp.dtype=fp16 is not supported on device={cfg.device!r}; use amp.dtype=bf16 or fp32")
    if cfg.tracking.flush_every < 1:
        raise UserError(f"tracking.flush_every={cfg.tracking.flush_every} must be >= 1")


def _device_available(device: str) -> bool:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        return False
    if dev.type == "cuda":
        return torch.cuda.is_available()
    mod = getattr(torch, dev.type, None)
    return bool(mod is not None and hasattr(mod, "is_available") and mod.is_available())


def _fp16_autocast_ok(device: str) -> bool:
    import torch

    return torch.amp.is_autocast_available(torch.device(device).type)
