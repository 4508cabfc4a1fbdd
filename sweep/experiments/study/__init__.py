"""``+experiment=sweep``: an Optuna 5 study of ``clip.max_norm`` × ``amp.dtype``, tracked in MLflow.

One invocation = one MLflow parent run and ``study.n_trials`` trials, each one ``run_training``
(a nested child run with its params, batched per-step metrics, ``steps.csv`` and summary metrics).
The study lives in an Optuna RDB storage (``sqlite:///<tracking dir>/optuna.db`` by default,
``study.storage=postgresql://…`` for shared workers) under a name derived from the task, so the
same command resumes the study and adds trials.

Modes (``study=pareto`` | ``study=constrained``):

- ``pareto``: two objectives, minimise (eval loss, clipping ratio); the parent run holds the Pareto
  front. Multi-objective studies cannot prune.
- ``constrained``: one objective, eval loss; ``trial.set_constraint`` keeps the clipping ratio in
  ``study.target_clip=[low, high]`` (TPE/NSGA-II read the constraints); a trial whose clipping
  ratio can no longer end in the band is pruned, else the mean training loss is reported every
  ``report_every`` steps and the pruner (``study.pruner``: Wilcoxon by default, or median) stops
  trials that fall behind (``pruning``).

Every invocation first enqueues one trial per dtype in ``study.dtypes`` (only the dtype is fixed;
the sampler draws ``max_norm``, or it is the anchor's p95 the first time), so both dtypes are
evaluated whatever the sampler. Trials train from the same seed (same init, same batches): they
differ only by ``max_norm`` and dtype. The sampler is seeded with ``cfg.seed + trials already in
the study``: a fresh study is reproducible and a resumed one does not replay its first draws.

Accounting: an invocation counts the optimizer steps its trials really ran (``on_step`` calls)
against ``n_trials × steps`` (the same trials unpruned), the seconds that saved (each pruned trial's steps
not run × its time per step in its training loop, ``pruning.seconds_saved``) and the time spent in
``trial.report`` / ``should_prune``; the parent logs ``trial_steps_run/_budget/_saved``, ``pruned_share``,
``prune_overhead_s``. A pruned trial's child run ends KILLED with tag ``pruned=true`` and its clip/skip
ratios and final loss over the steps it ran; a failing trial is FAIL in Optuna, its child FAILED with
tag ``error``, and the sweep goes on; a user mistake or Ctrl-C stops the sweep.

The pick: ``sweep.pick.pick_trial``, by the rules of ``sweep.pick.PICK_RULES``.

Workers: several invocations may share a study (``workers``): set-up runs under a study lock, and a
dead worker's trials and runs are recovered by the next one (at once on the same host).

Modules: ``storage`` (where the study lives, its name, sampler, pruner), ``pruning`` (the
constrained study's pruner), ``workers`` (liveness, recovery, the set-up lock), ``space`` (the
max_norm range and the dtype trials enqueued first), ``trial`` (one trial), ``progress`` (the live
display), ``trial_launch`` and ``trial_job`` (a trial as a torchrun job), ``entangle`` (the LR
check), ``sweep`` (``run_sweep``, the entry point); the trials table is ``sweep.results.study``.
"""
