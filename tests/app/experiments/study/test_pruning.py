"""The constrained study's pruner: the clipping-band rule against a brute-force reference, the pruner on a
real in-memory Optuna study, and (slow) a pruned sweep end to end through Optuna, MLflow and the report."""

from __future__ import annotations

import itertools

import optuna
import pytest
from mlflow import MlflowClient

from sweep import app
from sweep.config import validate
from sweep.errors import UserError
from sweep.experiments.study import storage
from sweep.experiments.study.pruning import CLIP_COUNTS, BandPruner, band_verdict, constrained_pruner, seconds_saved
from sweep.report.cli import main as report_main
from tests.app.experiments.study.test_sweep import STEPS, children, optuna_study, sweep_cfg
from tests.app.helpers import compose_cfg

BAND = (0.1, 0.3)


def final_ratios(taken: int, clipped: int, remaining: int) -> set[float]:
    """Every clipping ratio a run can end with: each remaining step clips, does not clip, or is skipped."""
    out = set()
    for future in itertools.product(("clip", "pass", "skip"), repeat=remaining):
        t = taken + sum(f != "skip" for f in future)
        c = clipped + future.count("clip")
        if t:
            out.add(c / t)
    return out


def test_above_verdict_is_exactly_no_completion_ends_in_or_below_the_band():
    steps = 8
    for step in range(1, steps + 1):
        for taken in range(step + 1):
            for clipped in range(taken + 1):
                ends = final_ratios(taken, clipped, steps - step)
                surely_above = bool(ends) and min(ends) > BAND[1]
                verdict = band_verdict(step, taken, clipped, steps, BAND, below_after=None)
                assert (verdict == "above") == surely_above, (step, taken, clipped)
                assert verdict in ("above", None)


def test_below_verdict_after_its_step_only():
    # 0 of 10 taken steps clipped: below the band's low edge from below_after on, never before
    assert band_verdict(10, 10, 0, 100, BAND, below_after=10) == "below"
    assert band_verdict(9, 9, 0, 100, BAND, below_after=10) is None
    assert band_verdict(10, 10, 0, 100, BAND, below_after=None) is None
    assert band_verdict(10, 10, 1, 100, BAND, below_after=10) is None  # 1/10 = low: in the band so far
    assert band_verdict(10, 10, 1, 100, (0.0, 0.3), below_after=10) is None


def report_losses(study: optuna.Study, losses: dict[int, float], counts=None) -> optuna.Trial:
    trial = study.ask()
    for step, loss in losses.items():
        trial.report(loss, step)
    if counts is not None:
        trial.set_user_attr(CLIP_COUNTS, counts)
    return trial


def frozen(study: optuna.Study, trial: optuna.Trial) -> optuna.trial.FrozenTrial:
    return study.get_trials(deepcopy=False)[trial.number]


def test_median_pruner_prunes_hopeless_trials_and_keeps_a_good_one_on_a_real_study():
    steps = 100  # median after 20 steps, below-band rule after 10
    pruner = constrained_pruner("median", steps, 1, (0.01, 0.2), warmup=0.2, report_every=10, below_after=0.1)
    study = optuna.create_study(pruner=pruner)
    first = report_losses(study, {10: 4.0, 20: 3.0, 30: 2.5})  # completes in band: the median's reference
    first.set_constraint("clip_ratio_low", -0.05)
    first.set_constraint("clip_ratio_high", -0.1)
    study.tell(first, 2.4)
    good = report_losses(study, {10: 4.1, 20: 2.9, 30: 2.4}, counts=[30, 30, 5])  # in band, ahead
    assert not good.should_prune()
    early = report_losses(study, {10: 4.5}, counts=[10, 10, 3])  # behind, but before the median's warm-up
    assert not early.should_prune()
    behind = report_losses(study, {10: 4.0, 20: 3.2}, counts=[20, 20, 3])  # in band, behind the median
    assert behind.should_prune()
    above = report_losses(study, {10: 3.0}, counts=[25, 25, 21])  # 21 > 0.2 × 100: can only end above
    assert above.should_prune() and study.pruner.verdict(frozen(study, above)) == "above"
    below = report_losses(study, {10: 3.0}, counts=[10, 10, 0])  # ahead on loss, never clipped by step 10
    assert below.should_prune() and study.pruner.verdict(frozen(study, below)) == "below"


def test_below_the_band_waits_for_a_feasible_trial_so_a_study_keeps_a_pick():
    """``+experiment=sweep study=constrained model=lstm steps=60``: every trial was pruned at step 6 with 0 of 6
    steps clipped ("ends below the band") and the study ended with no pick; unpruned, the first (the anchor
    window's p95) ended at 11.7%, in the band. The below-band rule is a guess: it waits for a feasible trial.
    The above-band rule (a certainty) does not wait."""
    pruner = constrained_pruner("wilcoxon", 60, 2, (0.01, 0.2), warmup=0.1, report_every=5, below_after=0.1)
    study = optuna.create_study(pruner=pruner)
    below = report_losses(study, {5: 4.0}, counts=[6, 6, 0])
    assert pruner.verdict(frozen(study, below)) == "below" and not below.should_prune()  # no trial done yet
    complete(study, [4.0, 3.5], 3.0, clip_ratio=0.5)  # completes above the band: infeasible, not a pick
    assert not below.should_prune()
    above = report_losses(study, {5: 4.0}, counts=[13, 13, 13])  # 13 > 0.2 × 60: can only end above
    assert above.should_prune()
    complete(study, [4.0, 3.5], 3.1, clip_ratio=0.05)  # feasible: the study has its pick
    assert below.should_prune() and report_losses(study, {5: 4.0}, counts=[6, 6, 0]).should_prune()


def complete(study: optuna.Study, losses: list[float], value: float, clip_ratio: float) -> None:
    """A finished trial reporting ``losses`` at steps 5, 10, …, with the constrained study's band constraint."""
    trial = report_losses(study, dict(zip(range(5, 5 * len(losses) + 1, 5), losses)))
    trial.set_constraint("clip_ratio_low", 0.01 - clip_ratio)
    trial.set_constraint("clip_ratio_high", clip_ratio - 0.2)
    study.tell(trial, value)


def test_wilcoxon_pruner_stops_a_trial_consistently_behind_the_best_feasible_one():
    pruner = constrained_pruner("wilcoxon", 100, 2, (0.01, 0.2), warmup=0.1, report_every=5, below_after=0.1)
    study = optuna.create_study(pruner=pruner)
    best = [4.0, 3.5, 3.2, 3.0, 2.9, 2.8]
    complete(study, best, 2.8, clip_ratio=0.1)  # feasible: the reference
    complete(study, [v - 0.5 for v in best], 2.3, clip_ratio=0.5)  # lower losses but infeasible: ignored
    counts = [30, 30, 5]  # in the band: only the loss decides
    windows = dict(zip(range(5, 31, 5), best))
    behind = report_losses(study, {k: v + 0.05 for k, v in windows.items()}, counts)
    assert behind.should_prune()  # worse on all 6 windows: one-sided p = 1/64
    few = report_losses(study, {k: v + 0.05 for k, v in windows.items() if k <= 15}, counts)
    assert not few.should_prune()  # worse on 3 windows: p = 1/8, not enough
    crossing = report_losses(study, {k: v + (0.05 if k <= 10 else -0.05) for k, v in windows.items()}, counts)
    assert not crossing.should_prune()  # slower start, then ahead: the heavily clipped trials' curve
    between = report_losses(study, {k: v - 0.01 for k, v in windows.items()}, counts)
    assert not between.should_prune()  # ahead of the feasible best, behind the infeasible trial
    fresh = optuna.create_study(pruner=pruner)
    complete(fresh, best, 2.3, clip_ratio=0.5)
    alone = report_losses(fresh, {k: v + 0.05 for k, v in windows.items()}, counts)
    assert not alone.should_prune()  # no feasible trial yet: nothing to be behind


def test_pruner_only_for_constrained():
    cfg = compose_cfg("+experiment=sweep", "study=constrained", "steps=100")
    p = storage.make_pruner(cfg)
    assert isinstance(p, BandPruner) and isinstance(p.inner, optuna.pruners.WilcoxonPruner)
    assert p.inner._n_startup_steps == 2 and p.inner._p_threshold == 0.05  # 0.1 × 100 steps = 2 windows of 5
    assert p.below_after == 10 and p.band == (0.01, 0.2) and p.steps == 100
    median = storage.make_pruner(
        compose_cfg("+experiment=sweep", "study=constrained", "steps=100", "study.pruner=median")
    )
    assert isinstance(median.inner, optuna.pruners.MedianPruner) and median.inner._n_warmup_steps == 10
    off = compose_cfg("+experiment=sweep", "study=constrained", "steps=100", "study.prune_below_after=null")
    assert storage.make_pruner(off).below_after is None
    assert isinstance(storage.make_pruner(compose_cfg("+experiment=sweep", "study=pareto")), optuna.pruners.NopPruner)
    assert isinstance(
        storage.make_pruner(compose_cfg("+experiment=sweep", "study=constrained", "study.pruner=none")),
        optuna.pruners.NopPruner,
    )


@pytest.mark.parametrize("value", ["1.0", "-0.1"])
def test_prune_below_after_out_of_range_is_one_line(value):
    cfg = compose_cfg("+experiment=sweep", "study=constrained", f"study.prune_below_after={value}")
    with pytest.raises(UserError) as e:
        validate(cfg)
    assert str(e.value) == f"study.prune_below_after={float(value)} must be in [0, 1) or null (no below-band pruning)"


#: A constrained sweep over τ in [0.01, 100] with the band [0, 0.05]: τ below the norms (~1) clip every
#: step and are pruned above the band; the others never clip and complete.
BAND_SWEEP = [
    "study=constrained",
    "study.dtypes=[bf16]",
    "study.anchor=null",
    "study.max_norm_low=0.01",
    "study.max_norm_high=100",
    "study.target_clip=[0,0.05]",
    "study.report_every=2",
]


@pytest.mark.slow
def test_pruned_constrained_sweep_records_pruned_trials_and_reports(tmp_path, store, capsys):
    """τ log-uniform on [0.01, 100] around the tiny task's norms (~1): the trials below the norms clip every
    step and can only end above the band [0, 0.05]; the others never clip and complete."""
    uri = store  # the default store, migrated already
    cfg = sweep_cfg(uri, *BAND_SWEEP, "study.n_trials=6")
    result = app.run(cfg, ["+experiment=sweep"])
    study = optuna_study(result, tmp_path)
    trials = study.get_trials()
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert pruned and complete and len(pruned) + len(complete) == len(trials) == 6
    above = [t for t in pruned if "above" in t.user_attrs["pruned_by"]]
    assert above, [t.user_attrs["pruned_by"] for t in pruned]
    for t in above:  # pruned at the step its clipped steps exceeded 0.05 × every step it could still take
        step, taken, clipped = t.user_attrs[CLIP_COUNTS]
        assert t.user_attrs["steps_run"] == step and clipped > 0.05 * (taken + STEPS - step)
        assert t.params["max_norm"] < min(c.params["max_norm"] for c in complete)
        assert t.constraints["clip_ratio_high"] > 0  # infeasible for the constrained sampler too
    assert result.pruned == len(pruned) and result.steps_run == sum(t.user_attrs["steps_run"] for t in trials)
    assert result.steps_saved == 6 * STEPS - result.steps_run > 0
    client = MlflowClient(uri)
    kids = {k.data.tags["trial"]: k for k in children(client, result.parent_run_id) if "trial" in k.data.tags}
    for t in pruned:
        run = kids[str(t.number)]
        assert run.info.status == "KILLED" and run.data.tags["pruned"] == "true"
        assert run.data.tags["pruned_by"] == t.user_attrs["pruned_by"]
        assert run.data.tags["pruned_at_step"] == str(int(t.user_attrs["steps_run"]))
    for t in complete:
        assert kids[str(t.number)].info.status == "FINISHED"
    assert result.pick is not None and result.pick.trial in {t.number for t in complete}
    out = tmp_path / "report.md"
    assert report_main(["--tracking-uri", uri, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"pick: trial {result.pick.trial}" in printed and f"pick: trial {result.pick.trial}" in out.read_text()


@pytest.mark.slow
def test_with_deferred_records_a_pruned_trial_counts_every_step_it_ran(tmp_path, store, monkeypatch):
    """Records every 5 steps (as on a GPU, where they wait for a flush): the pruner sees a step up to 4
    steps after it ran, so a pruned trial ran past its decision. Its steps.csv, ``steps_run`` and
    ``pruned_at_step`` all count those steps, and the invocation's total is their sum."""
    from clipamp_engine import step as engine_step

    real = engine_step.AmpTrainState._init_pipeline
    monkeypatch.setattr(
        engine_step.AmpTrainState, "_init_pipeline", lambda self, fused, log_every, f: real(self, fused, 5, f)
    )
    uri = store  # the default store, migrated already
    cfg = sweep_cfg(uri, *BAND_SWEEP, "study.n_trials=4")
    result = app.run(cfg, ["+experiment=sweep"])
    trials = optuna_study(result, tmp_path).get_trials()
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned
    client = MlflowClient(uri)
    kids = {k.data.tags["trial"]: k for k in children(client, result.parent_run_id) if "trial" in k.data.tags}
    for t in trials:
        run = kids[str(t.number)]
        rows = len(open(client.download_artifacts(run.info.run_id, "steps.csv")).read().splitlines()) - 1
        assert t.user_attrs["steps_run"] == rows and (rows % 5 == 0 or rows == STEPS)  # to a flush, not the decision
        if t in pruned:
            assert run.data.tags["pruned_at_step"] == str(rows)  # before: the decision's step, rows short of it
    assert result.steps_run == sum(t.user_attrs["steps_run"] for t in trials)


class _Always(optuna.pruners.BasePruner):
    def prune(self, study, trial) -> bool:
        return True


def test_a_trial_is_never_pruned_at_its_last_step():
    """Pruned at step 30 of 30 (seen with ``bench/bench_pruning.py -- steps=30``): nothing saved, and the trial
    that had run every step lost its evaluation and could not be picked. The step before still asks."""
    from types import SimpleNamespace

    from sweep.experiments.study.trial import Counters, Pruned, _Watch
    from sweep.run.loop import StepLog

    cfg = compose_cfg("+experiment=sweep", "study=constrained", "steps=30", "study.report_every=1")
    study = optuna.create_study(pruner=_Always())
    ctx = SimpleNamespace(
        cfg=cfg,
        study=study,
        storage=SimpleNamespace(record_heartbeat=lambda trial_id: None),
        counters=Counters(),
        ui=SimpleNamespace(step=lambda step: None),
    )

    def log(step: int):
        return StepLog(
            step=step, lr=1e-3, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, loss=2.0, scaler_scale=1.0, clipped=False
        )

    last = _Watch(ctx, study.ask())
    last.on_step(log(30))  # asks nothing
    with pytest.raises(Pruned, match="pruned at step 29"):
        _Watch(ctx, study.ask()).on_step(log(29))


@pytest.mark.slow
def test_a_study_with_every_trial_pruned_says_why_and_what_to_change(tmp_path, store, capsys):
    """τ in [0.001, 0.002], far below the tiny task's norms (~1): every step clips, every trial is pruned
    above the band. It said only "no completed trial: no pick"; now it names the cause and the keys."""
    uri = store  # the default store, migrated already
    band = ["study.max_norm_low=0.001", "study.max_norm_high=0.002", "study.n_trials=2"]
    result = app.run(sweep_cfg(uri, *BAND_SWEEP[:3], *band), ["+experiment=sweep"])
    trials = optuna_study(result, tmp_path).get_trials()
    assert result.pick is None and [t.state for t in trials] == [optuna.trial.TrialState.PRUNED] * 2
    assert all(t.user_attrs[CLIP_COUNTS][2] == t.user_attrs[CLIP_COUNTS][1] for t in trials)  # every step clipped
    out = capsys.readouterr().out.replace("\n", " ")
    assert "no completed trial: no pick: 2 of 2 trials clipped more than the band's 20.0% allows" in out, out
    assert "search larger τ: raise study.max_norm_low/max_norm_high, or widen study.target_clip" in out, out


def test_seconds_saved_counts_only_the_training_loops_per_step_time():
    # started at t=0 (model, data, MLflow run: 3 s), step 1 at 3.0 (warm-up: 1 s), step 2 at 4.0,
    # pruned at 6.0 after 5 steps: 0.5 s per step; 35 steps not run save 17.5 s, not 35 × 6.0 / 5 = 42 s
    assert seconds_saved(35, 5, [3.0, 4.0], 6.0) == pytest.approx(17.5)
    assert seconds_saved(39, 1, [3.0], 3.25) == pytest.approx(39 * 0.25)  # one step: from its start
    assert seconds_saved(35, 5, [], None) == 0.0


class _FromStep5(optuna.pruners.BasePruner):
    def prune(self, study, trial) -> bool:
        return trial.last_step is not None and trial.last_step >= 5


def test_a_pruned_trials_saving_is_its_loop_time_per_step(monkeypatch):
    """A trial that starts up in 3 s (model, data, run), takes 1 s for its first step and 0.5 s for each next
    one, pruned after step 5 of 30: 25 steps × 0.5 s = 12.5 s saved. It said 25 × 6 s / 5 = 30 s: the
    start-up counted as per-step time (a 40-step trial of 1.2 s said ≈38 s saved for 110 steps)."""
    from types import SimpleNamespace

    from sweep.experiments.study import trial as trial_mod
    from sweep.run.loop import StepLog

    clock = [0.0]
    monkeypatch.setattr(trial_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0], monotonic=lambda: clock[0]))
    cfg = compose_cfg("+experiment=sweep", "study=constrained", "steps=30", "study.report_every=1")
    study = optuna.create_study(pruner=_FromStep5())
    ctx = SimpleNamespace(
        cfg=cfg,
        study=study,
        storage=SimpleNamespace(record_heartbeat=lambda trial_id: None),
        counters=trial_mod.Counters(),
        ui=SimpleNamespace(step=lambda step: None),
    )
    watch = trial_mod._Watch(ctx, study.ask())
    clock[0] = 3.0  # start-up
    with pytest.raises(trial_mod.Pruned, match="pruned at step 5"):
        for step in range(1, 31):
            watch.on_batch(step, None)
            clock[0] += 1.0 if step == 1 else 0.5
            log = StepLog(
                step=step,
                lr=1e-3,
                grad_l2_pre_clip=1.0,
                grad_l2_post_clip=1.0,
                loss=2.0,
                scaler_scale=1.0,
                clipped=False,
            )
            watch.on_step(log)
    assert clock[0] == 6.0
    assert seconds_saved(30 - 5, 5, watch.starts, watch.stopped) == pytest.approx(12.5)
