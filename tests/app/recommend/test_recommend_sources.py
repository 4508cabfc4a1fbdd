"""``python -m sweep.recommend`` on what a run's own logs say about it: an MLflow run's calibration settings
are the defaults for that run, separate TensorBoard runs are not merged, a torn event file is said."""

from __future__ import annotations

import numpy as np
import pytest
from mlflow import MlflowClient

from clipamp_engine.records import CANONICAL_COLUMNS
from sweep.recommend import cli
from tests.app.recommend.test_recommend import numpy_tau, parse, trace

#: A calibrate run's calibrate.* params as the app logs them (the trainer integrations write tuples).
APP_PARAMS = {
    "calibrate.window": "60",
    "calibrate.every": "0",
    "calibrate.quantile": "0.9",
    "calibrate.start": "100",
    "calibrate.validate": "0",
    "calibrate.target_clip": "(0.01, 0.05)",
    "calibrate.candidates": "[0.5, 1.0, 2.0, 5.0]",
    "calibrate.confidence": "0.95",
    "calibrate.cap": "None",
}


def _recommend(argv: list[str]):
    ns = cli.parser().parse_args(argv)
    return cli.recommend(ns.paths[0], cli.options_from(ns), ns)


def test_an_mlflow_runs_own_calibrate_params_are_its_defaults(store, capsys):
    """A run that calibrated with calibrate.window=60 gets the τ of a 60-step window, not of the command's
    200-step default, and the report lists the settings it read; an option passed still wins."""
    from mlflow.entities import Metric, Param

    steps, lr, norms = trace()
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("app"))
    metrics = [Metric("grad_l2_pre_clip", float(x), 0, int(s)) for s, x in zip(steps, norms)]
    metrics += [Metric("lr", float(v), 0, int(s)) for s, v in zip(steps, lr)]
    params = [Param(k, v) for k, v in APP_PARAMS.items()]
    client.log_batch(run.info.run_id, metrics=metrics, params=params)
    where = [f"runs:/{run.info.run_id}", "--tracking-uri", store]
    rec = _recommend(where)
    assert (rec.options.window, rec.options.start, rec.options.quantile) == (60, 100, 0.9)
    assert rec.tau == pytest.approx(numpy_tau(steps, norms, 101, 160, 0.9), rel=1e-12)
    [note] = [n for n in rec.notes if "calibrate.* params" in n]
    assert "--window 60 --every 0 --quantile 0.9 --start 100 --validate 0 --target-clip 0.01 0.05" in note
    assert cli.main(where) == 0
    assert "note: calibration settings read from the run's calibrate.* params" in capsys.readouterr().out
    mine = _recommend([*where, "--window", "100", "--quantile", "band"])  # passed: they win, and are said
    assert (mine.options.window, mine.options.start, mine.options.quantile) == (100, 100, None)
    [note] = [n for n in mine.notes if "calibrate.* params" in n]
    assert "(passed here instead: --window 100 --quantile band)" in note


def test_a_run_without_calibrate_params_keeps_the_commands_defaults(store):
    from mlflow.entities import Metric, Param

    steps, lr, norms = trace()
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("hf"))
    metrics = [Metric("grad_norm", float(x), 0, int(s)) for s, x in zip(steps, norms)]
    client.log_batch(run.info.run_id, metrics=metrics, params=[Param("max_grad_norm", "5.0")])
    rec = _recommend([f"runs:/{run.info.run_id}", "--tracking-uri", store])
    assert rec.options.window == 200 and not [n for n in rec.notes if "calibrate.* params" in n]
    assert np.isfinite(rec.tau)


def _events(folder, steps, lr, norms):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for s, l, x in zip(steps.tolist(), lr.tolist(), norms.tolist()):
        writer.add_scalar("train/grad_norm", x, s)
        writer.add_scalar("train/learning_rate", l, s)
    writer.close()


def test_a_second_run_that_starts_over_is_refused_not_merged_as_a_resume(tmp_path, capsys):
    """HF run again into one output_dir with another logging_steps: runA logs steps 1–400, the later runB every
    5 steps from 5 with twice the norms. It starts over, not where runA left off: the command names both runs and
    their event files and asks for one, instead of merging a mixed grid whose τ is runB's."""
    import time

    steps, lr, norms = trace()
    _events(tmp_path / "runs" / "runA", steps, lr, norms)
    time.sleep(0.05)
    every5 = steps % 5 == 0
    _events(tmp_path / "runs" / "runB", steps[every5], lr[every5], 2 * norms[every5])
    with pytest.raises(SystemExit) as e:
        cli.main([str(tmp_path / "runs")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert "2 runs log train/grad_norm and runB (steps 5–400, every 5) starts over rather than where runA" in err
    assert "pass one of them" in err and err.count("events.out.tfevents.") == 2
    alone = _recommend([str(tmp_path / "runs" / "runA"), "--start", "100", "--window", "100", "--quantile", "0.95"])
    stored = norms.astype(np.float32).astype(np.float64)
    assert alone.tau == pytest.approx(numpy_tau(steps, stored, 101, 200), rel=1e-12)


def test_a_torn_event_file_is_said_not_read_as_a_shorter_log(tmp_path, capsys):
    """An event file cut mid-record reads (TensorBoard's reader stops there) with a note that it ended
    mid-record; one cut before its first scalar, or a file that is no event file, is one line saying so."""
    steps, lr, norms = trace()
    _events(tmp_path / "whole", steps, lr, norms)
    [whole] = (tmp_path / "whole").glob("*tfevents*")
    data = whole.read_bytes()
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / whole.name).write_bytes(data[:3000])
    rec = _recommend([str(tmp_path / "torn"), "--window", "10", "--start", "0"])
    assert 0 < len(rec.series.steps) < len(steps)
    assert any(f"{whole.name} ends mid-record at byte 3000" in n and "whole records" in n for n in rec.notes)
    assert not any("mid-record" in n for n in _recommend([str(whole), "--window", "10"]).notes)
    for cut, said in ((data[:100], "ends mid-record at byte 100"), (b"step,grad_norm\n1,2\n" * 9, "no TensorBoard")):
        bad = tmp_path / "bad.tfevents.bin"
        bad.write_bytes(cut)
        with pytest.raises(SystemExit) as e:
            cli.main([str(bad)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.splitlines()) == 1
        assert f"{bad}: unreadable TensorBoard events: the file " in err and said in err, err


def test_a_log_without_an_lr_says_the_norms_alone_placed_the_window(tmp_path, capsys):
    """A W&B chart export (a step and a norm, no LR): the placement line does not claim an LR stopped rising."""
    from tests.app.recommend.test_recommend import write_csv

    steps, _, norms = trace()
    path = write_csv(tmp_path / "chart.csv", {"Step": steps, "train/grad_norm": norms})
    assert cli.main([str(path), "--window", "100"]) == 0
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.startswith("window placement")]
    assert "no LR in the records, so no warm-up to wait for: placed by the norms alone from step 2" in line
    assert "the LR stopped rising" not in out


def test_the_step_columns_the_docs_name_are_read(tmp_path):
    """nanoGPT's iter (from 0, logged every 10 iterations: optimizer steps 1, 11, …) and W&B's run history of a
    Trainer run (its own _step row counter beside train/global_step) give the run's steps, not row numbers."""
    from tests.app.recommend.test_recommend import write_csv

    steps, lr, norms = trace()
    every10 = (steps - 1) % 10 == 0
    nano = write_csv(
        tmp_path / "nano.csv", {"iter": steps[every10] - 1, "lr": lr[every10], "grad_norm": norms[every10]}
    )
    rec = _recommend([str(nano), "--window", "100"])
    assert rec.series.steps.tolist() == steps[every10].tolist() and rec.series.interval == 10
    assert not any("no step column" in n for n in rec.notes)
    assert any("numbers its steps from 0 (as Lightning's global_step and nanoGPT's iter do)" in n for n in rec.notes)
    every5 = steps % 5 == 0
    history = {
        "_step": np.arange(every5.sum()),
        "train/global_step": steps[every5],
        "train/grad_norm": norms[every5],
        "train/learning_rate": lr[every5],
    }
    rec = _recommend([str(write_csv(tmp_path / "history.csv", history)), "--window", "100"])
    assert rec.series.steps.tolist() == steps[every5].tolist() and rec.series.lr_name == "train/learning_rate"


def test_a_sweeps_parent_run_names_its_picks_trial_run(store):
    """A sweep's parent run logs summaries only: the line names the run that holds the pick's norms (before:
    'no gradient-norm metric …: pass --norm NAME', a flag no name of that run could satisfy)."""
    from mlflow.entities import Metric

    client = MlflowClient(store)
    exp = client.create_experiment("sweep")
    parent = client.create_run(exp, run_name="sweep-s", tags={"sweep_role": "parent", "study": "s"}).info.run_id
    client.log_batch(parent, metrics=[Metric("pick_trial", 1.0, 0, 0), Metric("pick_max_norm", 2.0, 0, 0)])
    ids = [
        client.create_run(exp, tags={"study": "s", "sweep_role": "trial", "trial": str(n)}).info.run_id  # any worker's
        for n in (0, 1)
    ]
    with pytest.raises(cli.UserError) as refused:
        _recommend([f"runs:/{parent}", "--tracking-uri", store])
    assert f"pass runs:/{ids[1]} (trial 1, the pick) or another trial's run id" in str(refused.value)
    assert "--norm" not in str(refused.value)


def test_a_checkpoint_taken_mid_run_places_the_window_for_the_runs_max_steps(tmp_path, capsys):
    """``checkpoint-250`` of a 400-step Trainer run: the live callback placed its window with the run's end
    (``max_steps``) in view; the log's own 250 steps forced the window before the warm-up had settled."""
    import json

    steps, lr, norms = trace()
    history = [{"step": int(s), "learning_rate": float(x), "grad_norm": float(g)} for s, x, g in zip(steps, lr, norms)]
    states = {}
    for name, upto in (("whole", 400), ("checkpoint-250", 250)):
        states[name] = tmp_path / name / "trainer_state.json"
        states[name].parent.mkdir()
        states[name].write_text(json.dumps({"max_steps": 400, "logging_steps": 1, "log_history": history[:upto]}))
    whole, cut = (parse([str(states[k]), "--window", "100"]) for k in ("whole", "checkpoint-250"))
    assert cut.clip.placement == whole.clip.placement and cut.tau == whole.tau
    start = whole.clip.placement.start
    assert start > 51 and whole.tau == pytest.approx(numpy_tau(steps, norms, start, start + 99), rel=1e-12)
    assert cli.main([str(states["checkpoint-250"]), "--window", "100", "--quantile", "0.95"]) == 0
    assert "the run's max_steps=400 (from the state; the log ends at step 250)" in capsys.readouterr().out


def test_an_mlflow_runs_diagnosis_sees_its_clipping_and_its_skipped_steps(store):
    """A clipamp run's MLflow metrics say which steps it clipped (``grad_l2_post_clip`` below the pre-clip
    norm) and which it skipped (no norm logged): the diagnosis of ``runs:/ID`` names the same patterns as
    the diagnosis of the run's own records (sustained clipping, non-finite steps), not "no findings"."""
    from mlflow.entities import Metric

    from clipamp_engine.diagnosis import diagnose

    rng = np.random.default_rng(3)
    steps = np.arange(1, 301)
    pre = rng.lognormal(0.0, 0.3, len(steps))
    tau = float(np.quantile(pre, 0.8))  # clips ~20% of the steps after step 100: above the 5% band
    post = np.where((steps > 100) & (pre > tau), tau, pre)
    refused = {150, 151, 220}  # a run logs no non-finite norm: these steps are absent from the history
    rows = [
        {"step": int(s), "lr": 1e-3, "grad_l2_pre_clip": float(p) if s not in refused else np.nan,
         "grad_l2_post_clip": float(q) if s not in refused else np.nan, "skipped": s in refused,
         "skip_reason": "nonfinite_grad" if s in refused else ""}
        for s, p, q in zip(steps, pre, post)
    ]  # fmt: skip
    expected = sorted(f.kind for f in diagnose(rows))
    assert {"sustained_clipping", "nonfinite"} <= set(expected)
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("app"))
    logged = [(s, p, q) for s, p, q in zip(steps, pre, post) if s not in refused]
    metrics = [Metric("grad_l2_pre_clip", float(p), 0, int(s)) for s, p, _ in logged]
    metrics += [Metric("grad_l2_post_clip", float(q), 0, int(s)) for s, _, q in logged]
    metrics += [Metric("lr", 1e-3, 0, int(s)) for s, _, _ in logged]
    client.log_batch(run.info.run_id, metrics=metrics)
    rec = _recommend([f"runs:/{run.info.run_id}", "--tracking-uri", store, "--window", "60"])
    assert sorted(f.kind for f in rec.findings) == expected


def test_an_app_runs_steps_csv_is_read_with_the_config_beside_it(tmp_path, store, capsys):
    """An app run's steps.csv sits beside its config.yaml (the run's resolved config, as the app writes it):
    its calibrate.* are the defaults, as for runs:/ID of the same run, so both give the run's τ and say where
    they read them; a Hydra folder's .hydra/config.yaml too. A clipamp CSV with no config says it uses defaults."""
    from mlflow.entities import Metric, Param

    from sweep.config.convert import as_yaml, flat_params
    from tests.app.helpers import compose_cfg
    from tests.app.recommend.test_recommend import N, write_csv

    steps, lr, norms = trace()
    cfg = compose_cfg("+experiment=calibrate", "calibrate.window=60", "calibrate.start=100", "calibrate.quantile=0.9")
    cols = [steps, lr, norms, norms, np.ones(N), ["False"] * N, [""] * N, np.ones(N)]
    run = tmp_path / "artifacts"
    run.mkdir()
    path = write_csv(run / "steps.csv", dict(zip(CANONICAL_COLUMNS, cols)))
    (run / "config.yaml").write_text(as_yaml(cfg))
    rec = _recommend([str(path)])
    assert (rec.options.window, rec.options.start, rec.options.quantile) == (60, 100, 0.9)
    assert rec.tau == pytest.approx(numpy_tau(steps, norms, 101, 160, 0.9), rel=1e-12)
    [note] = [n for n in rec.notes if "calibration settings read from" in n]
    assert f"the run's config {run / 'config.yaml'} (calibrate.*): --window 60" in note
    client = MlflowClient(store)  # the same run through its MLflow params
    mlflow_run = client.create_run(client.create_experiment("app"))
    metrics = [Metric("grad_l2_pre_clip", float(x), 0, int(s)) for s, x in zip(steps, norms)]
    metrics += [Metric("lr", float(v), 0, int(s)) for s, v in zip(steps, lr)]
    params = [Param(k, str(v)) for k, v in flat_params(cfg).items() if k.startswith("calibrate.")]
    client.log_batch(mlflow_run.info.run_id, metrics=metrics, params=params)
    assert _recommend([f"runs:/{mlflow_run.info.run_id}", "--tracking-uri", store]).tau == rec.tau
    hydra = tmp_path / "hydra_out"
    (hydra / ".hydra").mkdir(parents=True)
    (hydra / ".hydra" / "config.yaml").write_text(as_yaml(cfg))
    (hydra / "steps.csv").write_bytes(path.read_bytes())
    assert _recommend([str(hydra / "steps.csv")]).tau == rec.tau
    alone = tmp_path / "steps.csv"
    alone.write_bytes(path.read_bytes())
    bare = _recommend([str(alone)])
    assert bare.options.window == 200 and not [n for n in bare.notes if "calibration settings read from" in n]
    assert any(
        "no run config (steps.clipamp.yaml, config.yaml or .hydra/config.yaml) beside steps.csv" in n
        for n in bare.notes
    )
    assert cli.main([str(alone)]) == 0
    assert "the calibration settings are this command's defaults and options" in capsys.readouterr().out


def test_an_app_run_stopped_early_is_replayed_for_the_steps_it_planned(tmp_path, store):
    """A +experiment=calibrate run of steps=2000 killed at step 400: its window waited for the warm-up (the run had
    room to), so its steps.csv and runs:/ID place it there too, not at step 1 as a 400-step run must."""
    from mlflow.entities import Metric, Param

    from sweep.config.convert import as_yaml, flat_params
    from tests.app.helpers import compose_cfg
    from tests.app.recommend.test_recommend import write_csv

    steps, lr, norms = trace(400)
    cfg = compose_cfg("+experiment=calibrate", "steps=2000")
    cols = [steps, lr, norms, norms, np.ones(400), ["False"] * 400, [""] * 400, np.ones(400)]
    path = write_csv(tmp_path / "steps.csv", dict(zip(CANONICAL_COLUMNS, cols)))
    (tmp_path / "config.yaml").write_text(as_yaml(cfg))
    rec = _recommend([str(path)])
    s = rec.clip.summaries[0]
    assert rec.clip.placement.rule == "auto" and s.start_step == rec.clip.placement.start > 50  # after the warm-up
    assert rec.tau == pytest.approx(numpy_tau(steps, norms, s.start_step, s.end_step, rec.clip.quantile), rel=1e-12)
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("app"))
    metrics = [Metric("grad_l2_pre_clip", float(x), 0, int(i)) for i, x in zip(steps, norms)]
    metrics += [Metric("lr", float(v), 0, int(i)) for i, v in zip(steps, lr)]
    params = [
        Param(k, str(v)) for k, v in flat_params(cfg).items() if k.startswith("calibrate.") or k in ("run", "steps")
    ]
    client.log_batch(run.info.run_id, metrics=metrics, params=params)
    assert _recommend([f"runs:/{run.info.run_id}", "--tracking-uri", store]).tau == rec.tau


@pytest.mark.parametrize(
    ("overrides", "window"),
    [
        (["+experiment=train", "clip=norm"], 200),  # clipped at a fixed τ: its calibrate.* were never used
        (["+experiment=train", "clip=calibrated", "calibrate.window=60", "calibrate.start=100"], 60),
    ],
)
def test_a_run_that_did_not_calibrate_keeps_the_commands_defaults(tmp_path, store, overrides, window):
    """Every app run logs calibrate.* (and config.yaml holds them), a clip=norm train run too: there they are
    clip=calibrated's unused defaults (a 100-step p95 window from step 1, warm-up included), not the run's
    choice, so neither its steps.csv nor runs:/ID reads them, and the report says so; a train run that
    calibrated (clip=calibrated) is read with its own."""
    from mlflow.entities import Metric, Param

    from sweep.config.convert import as_yaml, flat_params
    from tests.app.helpers import compose_cfg
    from tests.app.recommend.test_recommend import N, write_csv

    steps, lr, norms = trace()
    cfg = compose_cfg(*overrides)
    cols = [steps, lr, norms, norms, np.ones(N), ["False"] * N, [""] * N, np.ones(N)]
    path = write_csv(tmp_path / "steps.csv", dict(zip(CANONICAL_COLUMNS, cols)))
    (tmp_path / "config.yaml").write_text(as_yaml(cfg))
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("train"))
    metrics = [Metric("grad_l2_pre_clip", float(x), 0, int(s)) for s, x in zip(steps, norms)]
    metrics += [Metric("lr", float(v), 0, int(s)) for s, v in zip(steps, lr)]
    params = [Param(k, str(v)) for k, v in flat_params(cfg).items() if k.startswith("calibrate.") or k == "run"]
    params.append(Param("clip.mode", cfg.clip.mode))
    client.log_batch(run.info.run_id, metrics=metrics, params=params)
    for where in ([str(path)], [f"runs:/{run.info.run_id}", "--tracking-uri", store]):
        rec = _recommend(where)
        assert rec.options.window == window
        said = [n for n in rec.notes if "clip.mode=norm, not calibrated" in n]
        assert bool(said) == (window == 200)
        if window == 200:
            assert rec.tau == _recommend([*where, "--window", "200"]).tau
        else:
            assert rec.tau == pytest.approx(numpy_tau(steps, norms, 101, 160, 0.95), rel=1e-12)


def test_an_option_refused_beside_the_runs_own_setting_says_it_is_the_runs(tmp_path, capsys):
    """An integration's CSV calibrated with every=20 (its steps.clipamp.yaml): ``--window 122``, as a short
    window's warning asks, is refused beside ``--every 20``, which the command line did not pass: the line says
    that option is the run's and where it was read, and passing it (``--every 0``) is then accepted."""
    from clipamp_engine.clip.calibrated import RECOMMENDED
    from sweep.run.csv_settings import write_settings
    from tests.app.recommend.test_recommend import write_csv

    steps, lr, norms = trace()
    path = write_csv(tmp_path / "steps.csv", {"step": steps, "grad_l2_pre_clip": norms, "lr": lr})
    options = {**{k: v for k, v in RECOMMENDED.items() if k != "cap"}, "window": 20, "every": 20}
    write_settings(path, run="trainer", options=options, lengths=[[0, int(steps[-1])]], apply=False)
    with pytest.raises(SystemExit) as e:
        cli.main([str(path), "--window", "122"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --every 20 must be 0 (one window) or an integer >= --window 122 (--every: the run's, read from the "
        f"run's config {tmp_path / 'steps.clipamp.yaml'} (calibrate.*); pass it here to override)"
    ]
    assert cli.main([str(path), "--window", "122", "--every", "0"]) == 0
    assert "Calibration window, steps" in capsys.readouterr().out
