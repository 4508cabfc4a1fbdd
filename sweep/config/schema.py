"""The app's config schema: one structured-config dataclass per ``conf/`` group, in one place.

Hydra composes ``conf/`` onto ``Config`` (registered as ``base_config``), so unknown keys and wrong
types are refused while composing; ``sweep.config.validate`` then checks meaning. The YAML files
set only what differs from the defaults here (a test keeps it that way).

Choices: OmegaConf 2.3 refuses ``typing.Literal`` annotations ("Unexpected type annotation"), and
an ``Enum`` would change every logged value and message. So a choice is a ``str`` field made with
``choice(default, ALLOWED)``: the allowed tuple rides in the field's metadata, the one place
``validate`` (and ``build_task``) read it from. Engine-owned choices (dtypes, clip modes) come from
the engine itself.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from clipamp_engine.calibration import CalibrationWindows
from clipamp_engine.clip import CLIP_MODES, clip_mode_options
from clipamp_engine.step import DTYPES

RUNS = ("calibrate", "train", "sweep", "spike")
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("cosine", "linear", "constant")
MODEL_NAMES = ("gpt", "lstm", "linear", "custom", "hf")
ATTENTION = ("auto", "sdpa", "eager")  # model.attention: how sweep.tasks.models.GPT computes attention
DATA_NAMES = ("stdlib", "text", "synthetic", "hf")
STUDY_MODES = ("pareto", "constrained", "entangle")
SAMPLERS = ("tpe", "random", "nsga2")
PRUNERS = ("wilcoxon", "median", "none")
STRATEGIES = ("auto", "none", "ddp", "fsdp2")


def choice(default: str | None, allowed: tuple[str, ...], fix: str = "") -> Any:
    """A ``str`` field whose value must be one of ``allowed`` (``fix``: how to pass a valid one)."""
    return field(default=default, metadata={"choices": tuple(allowed), "fix": fix})


@dataclass
class ModelConfig:
    """Which network to train (``conf/model/``). Defaults are the ``gpt`` task (~0.8M params)."""

    name: str = choice("gpt", MODEL_NAMES, "pass model=gpt (or lstm, linear, custom, hf)")
    _target_: str | None = None  # custom: dotted path of an nn.Module class/factory
    loss_target: str | None = None  # custom: dotted path of loss_fn(output, targets)
    kwargs: dict[str, Any] = field(default_factory=dict)  # custom: constructor kwargs
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    block_size: int = 128  # >= data.seq_len
    dropout: float = 0.0
    attention: str = choice("auto", ATTENTION)  # gpt: auto, sdpa or eager (sweep.tasks.models.use_eager)
    hidden: int = 256  # lstm hidden size (n_layer layers)
    in_features: int = 16  # linear
    out_features: int = 1  # linear
    # hf: a transformers causal LM, randomly initialised from ``config`` (``model_type`` + the
    # config class's keys; vocab_size null = the tokenizer's) or loaded from ``pretrained``
    config: dict[str, Any] = field(default_factory=dict)
    pretrained: str | None = None  # hf: a local save_pretrained directory (never downloaded)
    # any model: parameter-name regexes (re.search); frozen parameters are left out of the
    # optimizer, of every norm and of the forensics
    freeze: list[str] = field(default_factory=list)  # these do not train
    train_only: list[str] = field(default_factory=list)  # if set, only these train


@dataclass
class DataConfig:
    """Where batches come from (``conf/data/``). Defaults: the stdlib's own source code."""

    name: str = choice("stdlib", DATA_NAMES, "pass data=stdlib (or text, synthetic, hf)")
    path: str | None = None  # text: a corpus file or a directory of files
    batch_size: int = 16
    seq_len: int = 128  # max tokens per sequence (<= model.block_size for gpt)
    max_files: int = 400  # stdlib: cap on documents read (deterministic choice)
    eval_fraction: float = 0.05  # held-out documents
    eval_batches: int = 4
    # hf (and stdlib/text under model=hf): tokenized text
    files: Any = None  # hf: a file, a glob or a list of them (text/json/jsonl/parquet/csv/arrow)
    format: str | None = None  # hf: datasets builder (text|json|parquet|csv|arrow); null = by extension
    text_field: str = "text"  # hf: the column holding the text
    field: str | None = None  # hf, json: the key of the list of records in one JSON object (datasets' field=)
    source_field: str | None = None  # hf: the column that becomes data_source (null: the file name)
    tokenizer: str | None = None  # local tokenizer dir; null: model.pretrained's, else a BPE trained once
    vocab_size: int = 4096  # the trained BPE's vocabulary
    packing: bool = True  # true: documents back to back (EOS between); false: one padded document per row
    cache_dir: str | None = None  # trained tokenizers; null: beside the data (else ~/.cache/clipamp)


@dataclass
class OptimConfig:
    """Optimizer and LR schedule (warmup then cosine/linear decay to ``min_lr_ratio``·lr)."""

    name: str = choice("adamw", OPTIMIZERS)
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    momentum: float = 0.9  # sgd only
    warmup_steps: int = 20
    schedule: str = choice("cosine", SCHEDULES)
    min_lr_ratio: float = 0.1


@dataclass
class AmpConfig:
    """Autocast dtype and the loss scaler (fp16 only): ``HysteresisScaler``, DeepSpeed's overflow
    rule (``hysteresis``) with ``torch.amp.GradScaler``'s growth count (× ``growth_factor`` after
    ``growth_interval`` clean steps, one step before DeepSpeed's ``scale_window`` would grow)."""

    dtype: str = choice("bf16", tuple(DTYPES))
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
    """``clip=MODE`` and the options of every mode: exactly the union of
    ``clipamp_engine.clip_mode_options(mode)`` over ``CLIP_MODES`` but ``calibrated`` (tested),
    whose options are ``calibrate.*`` (``CalibrateConfig``): ``clip=calibrated`` reads them there.

    ``conf/clip/MODE.yaml`` lists its mode's options at the engine defaults (tested); the others
    stay null. An option set for a mode that does not take it is refused.
    """

    mode: str = choice("norm", tuple(CLIP_MODES), "pass clip=MODE, e.g. clip=norm (docs/clipping.md)")
    max_norm: float | None = None  # norm, dpsgd: τ; zscore: optional ceiling
    clip_value: float | None = None  # value
    # staged: [[start_step, τ], ...]; typed Any inside: OmegaConf 2.3 turns the ints of a list[float] into
    # floats but refuses them in a list[list[float]], so clip.stages=[[0,2.0]] would fail to compose
    stages: list[list[Any]] | None = None
    max_norms: list[float] | None = None  # per_group: τ_j by optimizer param group
    patterns: dict[str, float] | None = None  # per_group: {name regex: τ_j}
    rest_max_norm: float | None = None  # per_group: τ for params matching no pattern
    clip_factor: float | None = None  # agc
    eps: float | None = None  # agc, zscore
    exclude: list[str] | None = None  # agc: name regexes left unclipped
    exclude_1d: bool | None = None  # agc: leave biases / norm scales unclipped
    max_update_norm: float | None = None  # update: ρ
    decoupled_weight_decay: bool | None = None  # update: null = detect per group
    quantile: float | None = None  # quantile (AutoClip): q of the last `history` norms
    history: int | None = None  # quantile
    include_current: bool | None = None  # quantile: the paper's rule (true) or the autoclip package's (false)
    alpha: float | None = None  # zscore (ZClip)
    z_thresh: float | None = None  # zscore
    warmup_steps: int | None = None  # zscore
    clip_option: str | None = None  # zscore: adaptive_scaling | mean
    noise_multiplier: float | None = None  # dpsgd: σ
    per_layer: bool | None = None  # dpsgd: clip each parameter tensor to max_norm
    seed: int | None = None  # dpsgd: noise RNG seed

    def __post_init__(self) -> None:
        """``clip.stages``' numbers as floats, as the YAML writes them (``[[0,2]]`` logs as ``[[0.0, 2.0]]``);
        anything else stays for the engine's policy to refuse by name."""
        if self.stages is not None:
            number = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
            self.stages = [[float(v) if number(v) else v for v in stage] for stage in self.stages]


#: The engine's defaults of ``clip=calibrated`` (``CalibratedClip``, whose window, quantile and
#: candidates are ``clipamp_engine.calibration.DEFAULT_*``): the defaults of ``calibrate.*``.
CALIBRATED = clip_mode_options("calibrated")


def _engine(key: str) -> Any:
    """A ``calibrate.*`` field defaulting to ``CalibratedClip``'s ``key`` (a fresh copy of a list)."""
    return field(default_factory=lambda: copy.deepcopy(CALIBRATED[key]))


@dataclass
class CalibrateConfig:
    """Calibration windows: record pre-clip norms for ``window`` steps (clipping off, or at
    ``cap``), then clip at τ = Quantile_q(norms), q = ``quantile``; ``every``: repeat windows.

    The one home of ``clip=calibrated``'s options: exactly ``CalibratedClip``'s (tested), at its
    defaults. ``+experiment=calibrate`` runs ``clip=calibrated`` with them (``calibrated``), and so
    does any run given ``clip=calibrated``; the spike's calibrated arm and the sweep's anchor window too."""

    window: int = _engine("window")
    quantile: float | None = _engine("quantile")  # null: aim τ at the middle of target_clip (q = 1 − (low + high)/2)
    cap: float | None = _engine("cap")  # clipping during a window: None = off, or a conservative cap
    every: int = _engine("every")  # repeat a window every N steps (0: once)
    candidates: list[float] = _engine("candidates")
    # where the first window starts: "auto" (after the LR warm-up and the norms' initial transient,
    # clipamp_engine.placement) or N (after N steps; 0: at step 1)
    start: Any = _engine("start")
    validate: int = _engine("validate")  # held-out steps after each window that check τ (0: all while τ is in force)
    target_clip: list[float] = _engine("target_clip")  # the clipping-ratio band τ is judged by
    confidence: float = _engine("confidence")  # level of the quantile and clipping-ratio intervals


@dataclass
class TrackingConfig:
    """MLflow. ``uri`` null: ``$MLFLOW_TRACKING_URI`` if set, else ``sqlite:///mlruns/mlflow.db``."""

    uri: str | None = None
    experiment: str = "clipamp"
    flush_every: int = 50  # per-step metrics are sent in batches of this many steps
    reconnect_s: float = 30.0  # a tracking server away at the end of a run: how long to wait for it
    plots: bool = True


@dataclass
class StudyConfig:
    """The Optuna sweep of max_norm × dtype (``+experiment=sweep``; ``conf/study/``)."""

    mode: str = choice("pareto", STUDY_MODES, "pass study=pareto, study=constrained or study=entangle")
    n_trials: int = 8  # trials added by one invocation (a resumed study keeps its earlier ones)
    name: str | None = None  # default: derived from task and mode; same name + storage = resume
    # default: sqlite:///<dir>/optuna.db beside a sqlite:///<dir>/mlflow.db tracking store (else mlruns/);
    # shared workers: postgresql://USER@HOST:PORT/DB with the password in $PGPASSWORD or ~/.pgpass
    storage: str | None = None
    sampler: str = choice("tpe", SAMPLERS)  # seeded from cfg.seed
    startup_trials: int = 4  # tpe: seeded random trials before TPE models the history
    dtypes: list[str] = field(default_factory=lambda: ["fp16", "bf16"])
    # max_norm search space: log-uniform [max_norm_low, max_norm_high] unless `anchor` is set:
    # anchor "window" runs a calibration window first (calibrate.window steps, no clipping), a run id
    # reuses a calibrate run's grad_norm_p50..p99; the range is then
    # [anchor_low * p50, anchor_high * p99] and each dtype is tried first at the run's p95.
    max_norm_low: float = 0.05
    max_norm_high: float = 20.0
    anchor: str | None = None
    anchor_low: float = 0.5
    anchor_high: float = 2.0
    # The band [low, high] of clipping ratios the pick accepts (constrained: also the trials' constraint);
    # spelled as calibrate.target_clip (study.target_clip_low/high are refused, naming this key).
    target_clip: list[float] = field(default_factory=lambda: [0.01, 0.2])
    # constrained only (multi-objective studies cannot prune): a trial whose clipping ratio can no longer
    # end in target_clip is pruned, else a pruner on the training loss decides (study/pruning.py):
    # wilcoxon (significantly worse than the best feasible trial) or median (than the completed median)
    pruner: str = choice("wilcoxon", PRUNERS)
    prune_warmup: float = 0.1  # fraction of steps a trial runs before the loss pruner may stop it
    # fraction of steps after which a trial clipping less than target_clip's low edge so far is pruned
    # (null: never); a trial that can only end above the band is pruned at once
    prune_below_after: float | None = 0.1
    report_every: int = 5  # steps between trial.report(mean training loss of those steps); each ≈ 1 storage commit
    # torch intra-op threads while the trials run (0: torch's default). 1 suits small CPU tasks on a
    # shared machine or several sweep workers per host: idle-spinning threads of an oversubscribed
    # CPU made the default sweep up to 6x slower here; 2 threads were only ~20% faster when idle.
    threads: int = 0
    # >1: each trial is a torchrun job of this many processes (dist.strategy: auto = ddp, or fsdp2) that this
    # sweep process launches and waits for; its objective comes from the job's MLflow run. No pruning.
    nproc_per_trial: int = 1
    # entangle (the LR check): optim.lr × lr_factors by τ ∈ {none} ∪ window quantiles, `seeds` seeds per cell
    lr_factors: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    entangle_quantiles: list[str] = field(default_factory=lambda: ["p90", "p50"])
    seeds: int = 2
    # A worker killed mid-trial: the next invocation marks its trial FAIL, its runs KILLED, and re-enqueues
    # its parameters once; at once on the same host (the worker's lock file is free), else once the
    # trial has sent no heartbeat for grace_period seconds (workers on other hosts; workers.py).
    heartbeat_interval: int = 10  # seconds between a running trial's heartbeats
    grace_period: int = 60  # a RUNNING trial of another host's worker silent this long is stale


#: The fp16 spike variant's sizes: fp16 matmuls have no fast CPU kernel (the default GPT takes ~1.7 s
#: a step in fp16), so it runs a smaller GPT (20–40 ms a step). ``amp.growth_interval=20`` lets the
#: loss scale climb to its ceiling within the run, where a long fp16 run sits (2^17–2^18 here).
FP16_OVERRIDES = [
    "model.d_model=32",
    "model.n_layer=2",
    "model.n_head=2",
    "model.block_size=64",
    "data.batch_size=8",
    "data.seq_len=64",
    "amp.growth_interval=20",
]


@dataclass
class SpikeConfig:
    """The bad-batch replay (``+experiment=spike``; see ``sweep.experiments.spike``)."""

    at_step: int = 150  # the corrupted batch is fed at this step (after a calibration window ends)
    factor: float = 20.0  # its pre-clip gradient norm = factor × the running peak
    peak_window: int = 50  # the running peak is over this many steps before the spike (0: since step 1)
    fixed_max_norm: float = 1.0  # the "common threshold" arm
    horizons: list[int] = field(default_factory=lambda: [1, 5, 20, 100])  # loss_excess_H, steps after
    recovery_tolerance: float = 0.05  # "recovered": loss within ±5% of the unspiked twin's to the end
    fp16: bool = True  # also run the fp16 variant (reference + calibrated, overflow expected)
    fp16_overrides: list[str] = field(default_factory=lambda: list(FP16_OVERRIDES))  # KEY=VALUE on top
    figure_out: str | None = None  # also copy the parent run's figure here, e.g. docs/spike.png


@dataclass
class FaultsConfig:
    """Fault injection (``sweep.run.faults``): the 1-based steps each fault hits; off by default."""

    inf_grad: list[int] = field(default_factory=list)
    nan_grad: list[int] = field(default_factory=list)
    nan_loss: list[int] = field(default_factory=list)
    loss_spike: list[int] = field(default_factory=list)  # float targets × spike_factor (a regression
    spike_factor: float = 1e8  # task's targets), else the loss × spike_factor
    overflow: list[int] = field(default_factory=list)
    overflow_factor: float = 1e5
    nan_input: list[int] = field(default_factory=list)


#: The faults: the step-list fields of ``FaultsConfig`` (the others are their factors).
FAULTS = tuple(k for k, v in vars(FaultsConfig()).items() if isinstance(v, list))


@dataclass
class DistConfig:
    """Several processes under ``torchrun`` (``sweep.distributed.launch``); ``auto``: ddp there, else none."""

    strategy: str = choice("auto", STRATEGIES)
    timeout_s: float = 600.0  # a collective waiting longer than this (a rank died or hangs) ends the run


@dataclass
class Config:
    run: str | None = choice(None, RUNS)  # set by +experiment=NAME
    steps: int = 300
    seed: int = 0
    device: str = "cpu"
    accumulation_steps: int = 1
    eval_every: int = 0  # 0: evaluate at the end only
    progress: bool = True
    progress_every: int = 50  # outside a terminal (nohup, CI, Slurm): one plain progress line every N steps
    checkpoint_every: int = 100  # also written at the step boundary after SIGINT/SIGTERM
    resume: str | None = None  # true: the latest run of this name with a checkpoint; or a run id
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
    dist: DistConfig = field(default_factory=DistConfig)


#: Keys spelled differently now: an override of one is refused with a line naming its new key
#: (``{value}``: the value the override gave).
RENAMED = dict.fromkeys(
    ("study.target_clip_low", "study.target_clip_high"),
    "study.target_clip=[low,high], one band as in calibrate.target_clip: pass e.g. study.target_clip=[0.01,0.2]",
) | {
    f"clip.{key}": f"calibrate.{key}: clip=calibrated reads its options from calibrate.*; "
    f"pass calibrate.{key}={{value}}"
    for key in CALIBRATED
    if key != "quantile"  # clip.quantile is clip=quantile's (AutoClip); clip_options refuses it for clip=calibrated
}


def register() -> None:
    """Register the schema so ``conf/config.yaml`` can extend it (defaults: ``base_config``)."""
    ConfigStore.instance().store(name="base_config", node=Config)


def window_ranges(cfg: Config) -> list[range]:
    """The calibration windows ``cfg.calibrate`` puts in a run of ``cfg.steps`` (1-based step ranges)."""
    return CalibrationWindows(cfg.calibrate.window, cfg.calibrate.every, cfg.steps).ranges()


def forensics_on(f: ForensicsConfig) -> list[str]:
    """The ``forensics.*`` overrides that turn forensics on, as a user writes them (``forensics.top_k=2``);
    ``[]``: forensics is off (no ``StepForensics``)."""
    flags = (("update_norm", f.update_norm), ("param_norm", f.param_norm), ("zero_grads", f.zero_grads))
    on = [f"forensics.{name}=true" for name, value in flags if value]
    return on + ([f"forensics.top_k={f.top_k}"] if f.top_k else [])


def calibrated(cfg: Config) -> Config:
    """``cfg`` with ``clip=calibrated``, which reads its options from ``calibrate.*``: what a calibrate
    run (or a spike's calibrated arm, or a sweep's anchor window) does, so its logged params say so
    (``clip.mode=calibrated`` beside ``calibrate.*``)."""
    c = copy.deepcopy(cfg)
    c.clip = ClipConfig(mode="calibrated")
    return c
