"""Schema of ``study`` (the Optuna sweep of max_norm × dtype), used by ``+experiment=sweep``.

``conf/study/pareto.yaml`` and ``conf/study/constrained.yaml`` fill it; unknown keys are
rejected while Hydra composes (structured config), ``sweep.study.validate_study`` checks meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class StudyConfig:
    mode: str = "pareto"  # pareto (loss vs clipping ratio) | constrained (loss, clip ratio in a band)
    n_trials: int = 8  # trials added by one invocation (a resumed study keeps its earlier ones)
    name: Optional[str] = None  # default: derived from task and mode; same name + storage = resume
    # default: sqlite:///<dir>/optuna.db beside a sqlite:///<dir>/mlflow.db tracking store (else mlruns/);
    # shared workers: postgresql://USER@HOST:PORT/DB with the password in $PGPASSWORD or ~/.pgpass
    storage: Optional[str] = None
    sampler: str = "tpe"  # tpe | random | nsga2 (seeded from cfg.seed)
    startup_trials: int = 4  # tpe: seeded random trials before TPE models the history
    dtypes: List[str] = field(default_factory=lambda: ["fp16", "bf16"])
    # max_norm search space: log-uniform [max_norm_low, max_norm_high] unless `anchor` is set:
    # anchor "window" runs a calibration window first (calibrate.window steps, no clipping), a run id
    # reuses a calibrate run's grad_norm_p50..p99; the range is then
    # [anchor_low * p50, anchor_high * p99] and each dtype is tried first at the run's p95.
    max_norm_low: float = 0.05
    max_norm_high: float = 20.0
    anchor: Optional[str] = None
    anchor_low: float = 0.5
    anchor_high: float = 2.0
    # The band of clipping ratios the pick accepts (constrained: also the trials' constraint).
    target_clip_low: float = 0.01
    target_clip_high: float = 0.2
    # constrained only (multi-objective studies cannot prune): median pruner on the training loss
    pruner: str = "median"  # median | none
    prune_warmup: float = 0.3  # fraction of steps a trial always runs before it may be pruned
    report_every: int = 10  # steps between trial.report(mean training loss of those steps); each ≈ 1 storage commit
    # torch intra-op threads while the trials run (0: torch's default). 1 suits small CPU tasks on a
    # shared machine or several sweep workers per host: idle-spinning threads of an oversubscribed
    # CPU made the default sweep up to 6x slower here; 2 threads were only ~20% faster when idle.
    threads: int = 0
    # A worker killed mid-trial: its trial stops sending heartbeats; the next invocation (or any
    # worker) marks it FAIL, its child run KILLED, and re-enqueues its parameters once.
    heartbeat_interval: int = 10  # seconds between a running trial's heartbeats
    grace_period: int = 60  # a RUNNING trial silent this long is stale
