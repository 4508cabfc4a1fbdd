"""``+experiment=sweep``: Optuna studies of max_norm × dtype into a temporary store, checked through
the Optuna and MLflow clients; the pick rule on hand-made tables; storage URL mistakes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from sweep import app
from sweep.commands import python_command
from sweep.config import validate
from sweep.errors import UserError
from sweep.experiments.study import space, storage
from sweep.experiments.study import trial as trial_module
from sweep.pick import pick_trial
from sweep.report.cli import main as report_main
from sweep.results.study import SweepResult
from sweep.tracking.tracker import Store
from tests.app.helpers import TINY, compose_cfg, run_cli

STEPS = 8

REPORT = python_command("sweep.report")  # the command the messages name


def sweep_cfg(uri: str, *overrides: str):
    return compose_cfg(
        "+experiment=sweep", *TINY, f"steps={STEPS}", f"tracking.uri={uri}", "optim.warmup_steps=2", *overrides
    )


def children(client: MlflowClient, parent_run_id: str) -> list:
    exp = client.get_run(parent_run_id).info.experiment_id
    return client.search_runs([exp], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}'")


def optuna_study(result: SweepResult, root: Path) -> optuna.Study:
    return optuna.load_study(study_name=result.study_name, storage=f"sqlite:///{root}/mlruns/optuna.db")


# ---------------------------------------------------------------- pareto: run, resume, artifacts, report


@pytest.fixture(scope="module")
def pareto(tmp_path_factory):
    root = tmp_path_factory.mktemp("pareto")
    uri = f"sqlite:///{root}/mlruns/mlflow.db"
    plain = ("study=pareto", "study.anchor=null")  # log-uniform [max_norm_low, max_norm_high]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # not study.threads: the suite runs with one thread (conftest.py)
    try:
        first = app.run(sweep_cfg(uri, *plain, "study.n_trials=3", "study.threads=1"), ["+experiment=sweep"])
        assert torch.get_num_threads() == 2  # study.threads applies to the trials only
    finally:
        torch.set_num_threads(threads)
    second = app.run(sweep_cfg(uri, *plain, "study.n_trials=2"), ["+experiment=sweep"])
    return root, uri, first, second


@pytest.mark.slow
def test_pareto_study_holds_every_trial_of_both_invocations(pareto):
    root, uri, first, second = pareto
    assert first.study_name == second.study_name  # same command → same study, resumed
    study = optuna_study(second, root)
    assert len(study.directions) == 2  # (eval loss, clipping ratio)
    trials = study.get_trials()
    assert len(trials) == 5 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    for invocation in (first, second):  # every invocation evaluates both dtypes
        mine = [t for t in trials if t.user_attrs["parent_run_id"] == invocation.parent_run_id]
        assert {t.params["dtype"] for t in mine} == {"fp16", "bf16"}
    for t in trials:
        assert t.values == [pytest.approx(t.user_attrs["eval_loss"]), pytest.approx(t.user_attrs["clip_ratio"])]
        assert storage.default_storage(uri) == f"sqlite:///{root}/mlruns/optuna.db"
    assert len(second.trials) == 5 and second.trials_run == 2 and second.anchor is None
    lo, hi = space.max_norm_range(compose_cfg("+experiment=sweep", "study.anchor=null"), None)
    assert all(lo <= t.params["max_norm"] <= hi for t in trials)
    assert second.steps_run == second.steps_budget == 2 * STEPS  # pareto cannot prune


@pytest.mark.slow
def test_parent_and_children_in_mlflow(pareto):
    root, uri, first, second = pareto
    client = MlflowClient(uri)
    for invocation, n in ((first, 3), (second, 2)):
        parent = client.get_run(invocation.parent_run_id)
        assert parent.info.status == "FINISHED" and parent.data.tags["sweep_role"] == "parent"
        params = parent.data.params  # what the trials varied, not the base config's 1.0 and bf16
        assert params["clip.max_norm"] == "swept: see the trials" and params["amp.dtype"].startswith("swept: ")
        kids = children(client, invocation.parent_run_id)
        assert len(kids) == n and {k.data.tags["dtype"] for k in kids} == {"fp16", "bf16"}
        for kid in kids:
            assert kid.info.status == "FINISHED"
            assert {"clip_ratio", "final_loss", "skip_ratio", "eval_loss", "grad_norm_p95"} <= set(kid.data.metrics)
            assert float(kid.data.params["clip.max_norm"]) == pytest.approx(float(kid.data.tags["max_norm"]), rel=1e-5)
            assert "steps.csv" in {a.path for a in client.list_artifacts(kid.info.run_id)}
            steps = client.get_metric_history(kid.info.run_id, "grad_l2_pre_clip")
            assert sorted(h.step for h in steps) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_parent_holds_table_front_plot_and_pick(pareto):
    root, uri, first, second = pareto
    client = MlflowClient(uri)
    run = client.get_run(second.parent_run_id)
    names = {a.path for a in client.list_artifacts(second.parent_run_id)}
    assert {"trials.csv", "trials.md", "pareto.csv", "feasible.csv", "pick.json", "plots"} <= names
    assert "plots/loss_vs_clip_ratio.png" in {a.path for a in client.list_artifacts(second.parent_run_id, "plots")}
    table = pd.read_csv(Path(client.download_artifacts(second.parent_run_id, "trials.csv")))
    assert len(table) == 5 and set(table["dtype"]) == {"fp16", "bf16"}
    pick = pick_trial(table, second.band)  # the logged pick is the rule applied to the logged table
    assert pick == second.pick
    assert run.data.tags["pick_dtype"] == pick.dtype and run.data.params["pick_trial"] == str(pick.trial)
    assert run.data.metrics["pick_max_norm"] == pytest.approx(pick.max_norm)
    assert run.data.tags["pick_rule"] == pick.rule
    front = table[table["pareto"]]
    done = table[table["state"] == "COMPLETE"]
    for _, p in front.iterrows():  # nothing strictly dominates a front point
        assert not (
            (done["eval_loss"] <= p["eval_loss"])
            & (done["clip_ratio"] <= p["clip_ratio"])
            & ((done["eval_loss"] < p["eval_loss"]) | (done["clip_ratio"] < p["clip_ratio"]))
        ).any()


@pytest.mark.slow
def test_report_command_reads_the_sweep(pareto, tmp_path, capsys):
    root, uri, first, second = pareto
    out = tmp_path / "report.md"
    assert report_main(["--tracking-uri", uri, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"Study {second.study_name}" in printed and "pick: trial" in printed
    md = out.read_text()
    assert f"Study `{second.study_name}`" in md and f"pick: trial {second.pick.trial}" in md


# ---------------------------------------------------------------- constrained: constraints, pruning, failures, anchor


class PruneFromTrial(optuna.pruners.BasePruner):
    """Prunes every trial numbered >= ``first`` once it has reported (deterministic)."""

    def __init__(self, first: int) -> None:
        self.first = first

    def prune(self, study, trial) -> bool:
        return trial.number >= self.first and trial.last_step is not None


@pytest.mark.slow
def test_constrained_sweep_prunes_fails_and_anchors(tmp_path, store, monkeypatch):
    uri = store  # the default store, migrated already
    real_run_training = trial_module.run_training

    def flaky(cfg, store, spec, hooks):  # trial 2 raises mid-run
        def hook(log):
            if hooks.step is not None:
                hooks.step(log)
            if "trial-2-" in spec.name and log.step == 3:
                raise RuntimeError("injected failure")

        return real_run_training(cfg, store, spec, dataclasses.replace(hooks, step=hook))

    monkeypatch.setattr(trial_module, "run_training", flaky)
    monkeypatch.setattr(storage, "make_pruner", lambda cfg: PruneFromTrial(3))
    cfg = sweep_cfg(
        uri,
        "study=constrained",
        "study.n_trials=4",
        "study.anchor=window",
        "calibrate.window=6",
        "study.report_every=2",
    )
    result = app.run(cfg, ["+experiment=sweep"])
    study = optuna_study(result, tmp_path)
    states = [t.state.name for t in study.get_trials()]
    assert states == ["COMPLETE", "COMPLETE", "FAIL", "PRUNED"]
    assert len(study.directions) == 1
    anchor = study.user_attrs["anchor"]
    lo, hi = space.max_norm_range(cfg, {k: anchor[k] for k in space.QUANTILE_KEYS})
    for t in study.get_trials():
        assert lo <= t.params["max_norm"] <= hi
    for t in study.get_trials()[:2]:  # the enqueued trial of each dtype sits at the window's p95
        assert t.params["max_norm"] == pytest.approx(anchor["p95"])
        c = t.user_attrs["clip_ratio"]
        assert t.constraints == {
            "clip_ratio_low": pytest.approx(cfg.study.target_clip[0] - c),
            "clip_ratio_high": pytest.approx(c - cfg.study.target_clip[1]),
        }
    assert {t.params["dtype"] for t in study.get_trials()[:2]} == {"fp16", "bf16"}
    pruned = study.get_trials()[3]
    assert pruned.intermediate_values and pruned.user_attrs["steps_run"] == 2  # first report, then pruned
    # steps accounting: what ran vs the same 4 trials unpruned
    assert result.steps_run == STEPS + STEPS + 3 + 2 and result.steps_budget == 4 * STEPS
    assert result.steps_saved == result.steps_budget - result.steps_run and result.pruned == 1
    client = MlflowClient(uri)
    kids = {k.data.tags.get("trial", k.data.tags["sweep_role"]): k for k in children(client, result.parent_run_id)}
    assert kids["anchor"].info.status == "FINISHED"
    assert {"final_loss", "grad_norm_p95"} <= set(kids["anchor"].data.metrics)
    anchor_id = kids["anchor"].info.run_id  # its report says no ratio after the window: no metric says one
    assert "clip_ratio" not in kids["anchor"].data.metrics
    report = open(client.download_artifacts(anchor_id, "report.md")).read()
    assert "Clipping ratio realised after the first window (every later step, at the τ in force): —" in report
    assert kids["2"].info.status == "FAILED" and "injected failure" in kids["2"].data.tags["error"]
    assert kids["3"].info.status == "KILLED" and kids["3"].data.tags["pruned"] == "true"
    for n in ("2", "3"):  # stopped trials keep their CSV and partial figures
        assert "steps.csv" in {a.path for a in client.list_artifacts(kids[n].info.run_id)}
        assert {"clip_ratio", "final_loss"} <= set(kids[n].data.metrics)
    assert client.get_run(result.parent_run_id).info.status == "FINISHED"
    assert result.pick is not None and result.pick.trial in (0, 1)

    # a calibrate run's id anchors a new study the same way as its window
    fresh = optuna.create_study()
    q = space.resolve_anchor(
        sweep_cfg(uri, f"study.anchor={kids['anchor'].info.run_id}"),
        fresh,
        Store(client, kids["anchor"].info.experiment_id, uri),
        result.parent_run_id,
        print,
    )
    assert q == pytest.approx({k: anchor[k] for k in space.QUANTILE_KEYS})
    # a trial's id is refused: its quantiles are over all its steps, warm-up included, not a window's
    trial_run = kids["0"]
    with pytest.raises(UserError, match=r"without a calibration window, so its grad_norm quantiles are over all"):
        space.resolve_anchor(
            sweep_cfg(uri, f"study.anchor={trial_run.info.run_id}"),
            optuna.create_study(),
            Store(client, trial_run.info.experiment_id, uri),
            result.parent_run_id,
            print,
        )


@pytest.fixture(scope="module")
def anchor_runs(tmp_path_factory):
    """A tracking store holding a trial's run (quantiles over all its steps: no window) and a run whose window
    quantiles include a 0; what the refusals below must leave alone."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('anchors')}/mlruns/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("clipamp")
    quantiles = {"grad_norm_p50": 1.0, "grad_norm_p90": 2.0, "grad_norm_p95": 2.5, "grad_norm_p99": 3.0}
    runs = {}
    for name, extra in {
        "no-window": {},
        "zero-quantile": {"window_clip_ratio_at_tau": 0.03, "grad_norm_p50": 0},
    }.items():
        run_id = client.create_run(exp, run_name=name, tags={"run": "sweep"}).info.run_id
        for k, v in {**quantiles, **extra}.items():
            client.log_metric(run_id, k, v)
        client.set_terminated(run_id)
        runs[name] = run_id
    return uri, client, runs


@pytest.mark.parametrize(
    "case, said",
    [
        ("no-window", r"without a calibration window, so its grad_norm quantiles are over all"),
        ("zero-quantile", r"quantiles .* are not all finite and > 0"),
        ("no-such-run", r"no such run in the tracking store"),
    ],
    ids=["no-window", "zero-quantile", "no-such-run"],
)
def test_an_anchor_run_it_cannot_anchor_on_is_refused_before_the_study_and_a_run_exist(anchor_runs, case, said):
    """``study.anchor=<a trial's id>`` was refused only once the study's parent run had opened: it stayed in
    the store, FAILED, a row of ``sweep.report`` with nothing in it; then only once the Optuna study had been
    created, which stayed in the storage, empty. Now nothing is created first."""
    uri, client, runs = anchor_runs
    with pytest.raises(UserError, match=said):
        app.run(sweep_cfg(uri, f"study.anchor={runs.get(case, '0' * 32)}"), ["+experiment=sweep"])
    left = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(r.info.run_id for r in left) == sorted(runs.values())
    assert optuna.get_all_study_summaries(uri.replace("mlflow.db", "optuna.db")) == []


def test_enqueue_each_dtype_once_at_the_anchor_until_evaluated():
    W, FAIL = optuna.trial.TrialState.WAITING, optuna.trial.TrialState.FAIL
    study = optuna.create_study(directions=["minimize", "minimize"])
    anchor = {"p50": 1.0, "p90": 2.0, "p95": 2.5, "p99": 3.0}

    def queued():
        return sorted(
            (t.system_attrs["fixed_params"]["dtype"], t.system_attrs["fixed_params"].get("max_norm"))
            for t in study.get_trials()
            if t.state == W
        )

    space.enqueue_dtypes(study, ["fp16", "bf16"], anchor)
    assert queued() == [("bf16", 2.5), ("fp16", 2.5)]
    t = study.ask()  # interrupted while training: FAIL, so fp16 at p95 is still to be evaluated
    assert (t.suggest_categorical("dtype", ["fp16", "bf16"]), t.suggest_float("max_norm", 0.5, 6, log=True)) == (
        "fp16",
        2.5,
    )
    study.tell(t, state=FAIL)
    space.enqueue_dtypes(study, ["fp16", "bf16"], anchor)  # bf16 is still queued: not queued twice
    assert queued() == [("bf16", 2.5), ("fp16", 2.5)]
    for _ in range(2):
        t = study.ask()
        t.suggest_categorical("dtype", ["fp16", "bf16"])
        study.tell(t, [1.0, t.suggest_float("max_norm", 0.5, 6, log=True)])
    space.enqueue_dtypes(study, ["fp16", "bf16"], anchor)  # p95 evaluated for both: only the dtype is fixed
    assert queued() == [("bf16", None), ("fp16", None)]


# ---------------------------------------------------------------- storage, names, validation


def test_default_storage_sits_beside_the_tracking_store():
    assert storage.default_storage("sqlite:///some/dir/mlflow.db") == "sqlite:///some/dir/optuna.db"
    assert storage.default_storage("sqlite:////abs/dir/mlflow.db") == "sqlite:////abs/dir/optuna.db"
    assert storage.default_storage("http://127.0.0.1:5000") == "sqlite:///mlruns/optuna.db"


@pytest.mark.parametrize(
    "url,message",
    [
        ("notaurl", "study.storage='notaurl' is not a database URL"),
        (
            "postgresql://u:hunter2@db:notaport/x",
            "study.storage='postgresql://u:***@db:notaport/x' is not a database URL",
        ),
        ("redis://localhost/0", "scheme 'redis' is not one of sqlite, postgresql, mysql"),
        (
            "postgresql://u:hunter2@127.0.0.1:1/optuna",
            "study.storage='postgresql://u:***@127.0.0.1:1/optuna' cannot be opened",
        ),
    ],
)
def test_bad_storage_is_one_line_without_password(url, message):
    with pytest.raises(UserError) as e:
        storage.open_storage(url)
    text = str(e.value)
    assert message in text and "\n" not in text and "hunter2" not in text


def test_an_unreachable_storage_gives_the_drivers_whole_reason():
    """The reason was the SQLAlchemy message cut at 200 characters, mid-word, its "(Background on this error
    at: https://sqlalche.me/…)" link included: "… accepting TCP/IP connections? (Backgroun)". The driver's own
    words come whole, without SQLAlchemy's link."""
    import psycopg

    url = "postgresql://u:hunter2@127.0.0.1:1/optuna"
    try:
        psycopg.connect("host=127.0.0.1 port=1 user=u password=hunter2 dbname=optuna", connect_timeout=5)
    except psycopg.OperationalError as e:
        said = " ".join(str(e).split())  # what the driver says, on one line
    with pytest.raises(UserError) as e:
        storage.open_storage(url)
    text = str(e.value)
    assert f"(OperationalError: {said})" in text and "Background on this error" not in text, text
    assert "\n" not in text and "hunter2" not in text


@pytest.mark.slow
def test_malformed_storage_url_exits_2_from_the_cli(tmp_path):
    res = run_cli("+experiment=sweep", "study.storage=notaurl", "progress=false", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: study.storage='notaurl' is not a database URL") and "Traceback" not in res.stderr


def test_study_name_is_stable_and_follows_the_task():
    base = storage.study_name(compose_cfg("+experiment=sweep"))
    assert base == storage.study_name(
        compose_cfg("+experiment=sweep", "study.n_trials=20", "study.storage=sqlite:///x.db")
    )
    assert base.startswith("gpt-stdlib-pareto-")
    assert base != storage.study_name(compose_cfg("+experiment=sweep", "steps=20"))
    assert base != storage.study_name(compose_cfg("+experiment=sweep", "model.d_model=32", "model.n_head=2"))
    assert storage.study_name(compose_cfg("+experiment=sweep", "study.name=mine")) == "mine"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["study.mode=grid"], "study.mode='grid' is not one of pareto, constrained"),
        (["study.n_trials=1"], "study.n_trials=1 must be >= 2"),
        (["study.dtypes=[fp8]"], "study.dtypes=['fp8'] must be distinct values of"),
        (["study.max_norm_low=5", "study.max_norm_high=1"], "must satisfy 0 < low < high"),
        (["study.anchor=latest"], "study.anchor='latest' is not 'window' or an MLflow run id"),
        (["study.target_clip=[0.5,0.1]"], "study.target_clip=[0.5, 0.1] must be [low, high] with 0 <= low <= high"),
        (["clip=none"], "clip=none: the sweep tunes the global-norm threshold"),
    ],
)
def test_study_checks_name_the_value(overrides, message):
    with pytest.raises(UserError) as e:
        validate(compose_cfg("+experiment=sweep", *overrides))
    assert message in str(e.value)


def test_unknown_study_key_is_rejected():
    with pytest.raises(Exception, match="study.n_trails"):
        compose_cfg("+experiment=sweep", "study.n_trails=3")


# a worker killed mid-trial (or in its anchor window): tests/reliability/test_sweep_workers.py


@pytest.mark.parametrize(
    "states, line",
    [
        (["COMPLETE", "PRUNED", "FAIL"], None),
        (
            ["COMPLETE", "RUNNING", "RUNNING"],
            "the pick covers the trials finished so far: 2 running in other workers; once they end, "
            f"`{REPORT}` gives the study's pick",
        ),
        (  # re-enqueued from a dead worker: nobody runs it yet (before: "running or queued in other workers")
            ["COMPLETE", "FAIL", "WAITING"],
            "the pick covers the trials finished so far: 1 queued, which the next run of this command takes "
            f"first; once they end, `{REPORT}` gives the study's pick",
        ),
        (
            ["RUNNING", "WAITING", "WAITING"],
            "the pick covers the trials finished so far: 1 running in other workers and 2 queued, which the next "
            f"run of this command takes first; once they end, `{REPORT}` gives the study's pick",
        ),
    ],
)
def test_the_trials_left_out_of_the_pick_are_named_by_where_they_are(states, line):
    import pandas as pd

    from sweep.experiments.study.sweep import unfinished_line

    assert unfinished_line(pd.Series(states)) == line
