"""``python -m sweep.recommend`` in-process: τ from a CSV, a TensorBoard event file and an MLflow run equals
the calibrate procedure recomputed with numpy (``np.quantile``'s default linear method, the engine's
definition) on the same series; a sparse series says what sampling does; bad input is one line, exit 2."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
from mlflow import MlflowClient

from clipamp_engine.band import clopper_pearson
from clipamp_engine.calibration import CalibrationWindows, quantile_ci, quantile_label
from clipamp_engine.clip.calibrated import CalibratedClip
from clipamp_engine.diagnosis import diagnose
from clipamp_engine.norms import CLIP_EPS
from clipamp_engine.placement import auto_window_start
from clipamp_engine.records import CANONICAL_COLUMNS
from sweep.commands import python_command
from sweep.recommend import cli
from sweep.recommend.replay import RECOMMEND_SPELLING

N = 400


def trace(n: int = N, seed: int = 0):
    """A warm-up (LR ramp over 50 steps, norms decaying from 4× their level), then stationary log-normal norms."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, n + 1)
    lr = np.minimum(steps / 50, 1.0) * 1e-3
    norms = np.exp(rng.normal(0.0, 0.3, n)) * (1 + 3 * np.exp(-steps / 30))
    return steps, lr, norms


def write_csv(path, columns: dict, keep=None):
    names = list(columns)
    rows = zip(*columns.values())
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names)
        for row in rows:
            if keep is None or keep(row):
                w.writerow([repr(float(v)) if isinstance(v, float | np.floating) else v for v in row])
    return path


#: What these tests calibrate with where a test passes no option of its own: a 100-step window at
#: Quantile_0.95, which a 400-step trace holds with room to check it (the command's defaults are
#: ``RECOMMENDED``'s, a 200-step window aimed at the band: ``test_defaults_are_the_runners``).
TEST_OPTIONS = {"--window": "100", "--quantile": "0.95"}


def with_options(args: list[str]) -> list[str]:
    return [*args, *(x for k, v in TEST_OPTIONS.items() if k not in args for x in (k, v))]


def main(args: list[str]) -> int:
    return cli.main(with_options(args))


def parse(args: list[str]):
    ns = cli.parser().parse_args(with_options(args))
    return cli.recommend(ns.paths[0], cli.options_from(ns), ns)


def numpy_tau(steps, norms, start: int, end: int, q: float = 0.95) -> float:
    inside = (steps >= start) & (steps <= end)
    return float(np.quantile(norms[inside], q))


def realised(steps, norms, end: int, tau: float) -> tuple[int, int]:
    after = norms[steps > end]
    return int((tau / (after + CLIP_EPS) < 1).sum()), len(after)


def test_fixed_start_tau_quantiles_and_band_check_equal_numpy(tmp_path, capsys):
    steps, lr, norms = trace()
    path = write_csv(tmp_path / "log.csv", {"step": steps, "learning_rate": lr, "grad_norm": norms})
    assert main([str(path), "--start", "60", "--window", "120"]) == 0
    out = capsys.readouterr().out
    rec = parse([str(path), "--start", "60", "--window", "120"])
    w = rec.clip.summaries[0]
    assert (w.start_step, w.end_step, w.n_finite) == (61, 180, 120)
    tau = numpy_tau(steps, norms, 61, 180)
    assert rec.tau == pytest.approx(tau, rel=1e-12, abs=0)
    for q in (0.5, 0.9, 0.99):
        assert w.quantiles[quantile_label(q)] == pytest.approx(numpy_tau(steps, norms, 61, 180, q), rel=1e-12)
    window = np.sort(norms[60:180])
    assert w.candidate_clip_ratios[2.0] == pytest.approx((window > 2.0).mean())
    clipped, taken = realised(steps, norms, 180, tau)  # every later step at τ (validate 0)
    check = rec.clip.checks()[0]
    assert (check.clipped, check.steps) == (clipped, taken) == (check.clipped, N - 180)
    assert (check.realised_low, check.realised_high) == clopper_pearson(clipped, taken)
    assert f"max_grad_norm={tau:.4g}" in out and f"realised {clipped / taken:.1%} ({clipped}/{taken} steps" in out
    assert "Calibration window, steps 61–180 (120 finite, 0 skipped)" in out


def test_confidence_sets_the_level_of_the_intervals(tmp_path):
    steps, lr, norms = trace()
    path = write_csv(tmp_path / "log.csv", {"step": steps, "grad_norm": norms})
    args = [str(path), "--start", "60", "--window", "120"]
    default, lower = parse(args), parse([*args, "--confidence", "0.8"])
    assert default.clip.confidence == 0.95 and lower.clip.confidence == 0.8
    ci = lower.clip.summaries[0].tau_ci
    assert ci == quantile_ci(norms[60:180].tolist(), 0.95, 0.8)
    wide = default.clip.summaries[0].tau_ci
    assert wide.low < ci.low <= ci.estimate == wide.estimate  # a lower level: a narrower interval


def test_auto_start_places_the_window_as_the_engine_does_after_the_logged_warmup(tmp_path, capsys):
    steps, lr, norms = trace()
    path = write_csv(tmp_path / "log.csv", {"step": steps, "lr": lr, "grad_norm": norms})
    rec = parse([str(path)])
    latest = N - 100 - 100 + 1  # the window and its validation fit in the run
    placement = auto_window_start(zip(steps.tolist(), lr.tolist(), norms.tolist()), latest=latest)
    assert placement.rule == "auto" and placement.warmup_end == 51  # the LR stopped rising at step 51
    assert rec.clip.placement == placement
    start = placement.start
    assert rec.tau == pytest.approx(numpy_tau(steps, norms, start, start + 99), rel=1e-12)
    assert rec.tau < numpy_tau(steps, norms, 1, 100)  # a window over the warm-up overstates τ
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert f"the window starts at step {start}" in out and "LR from lr" in out


def test_sparse_series_is_a_sample_and_says_what_that_does(tmp_path, capsys):
    steps, lr, norms = trace()
    path = write_csv(tmp_path / "log.csv", {"step": steps, "lr": lr, "grad_norm": norms}, keep=lambda r: r[0] % 5 == 0)
    assert main([str(path), "--start", "0", "--window", "98"]) == 0
    out = capsys.readouterr().out
    assert "grad_norm is logged every 5 steps: a 1-in-5 sample" in out
    assert "A 100-step window holds 20 norms" in out and "--window 98 → 100" in out
    assert "Calibration window, steps 1–100 (20 finite, 0 skipped)" in out  # its steps, not its first norm's (5)
    rec = parse([str(path), "--start", "0", "--window", "98"])
    kept = steps % 5 == 0
    assert rec.clip.summaries[0].n_finite == 20
    assert rec.tau == pytest.approx(numpy_tau(steps[kept], norms[kept], 1, 100), rel=1e-12)
    check = rec.clip.checks()[0]
    assert (check.clipped, check.steps) == realised(steps[kept], norms[kept], 100, rec.tau)
    assert "p95 from 20 norms has no 95% upper confidence bound" in out  # the interval of 20 norms
    assert main([str(path), "--start", "0", "--window", "100", "--every", "100"]) == 0
    out = capsys.readouterr().out
    assert all(f"{a}–{a + 99} │" in out for a in (1, 101, 201, 301)), out  # every window's own steps
    assert "a p95 interval at 95% needs ≥ 72 norms, --window ≥ 360" in out
    assert main([str(path), "--start", "0", "--window", "98", "--confidence", "0.8"]) == 0
    assert "a p95 interval at 80% needs ≥ 45 norms, --window ≥ 225" in capsys.readouterr().out  # min_window(0.95, 0.8)


def test_repeated_windows_equal_numpy_per_window(tmp_path):
    steps, lr, norms = trace(300, seed=3)
    path = write_csv(tmp_path / "log.csv", {"step": steps, "lr": lr, "grad_norm": norms})
    rec = parse([str(path), "--every", "100", "--window", "50", "--start", "20"])
    windows = CalibrationWindows(50, 100, 300, first=21).ranges()
    assert [(s.start_step, s.end_step) for s in rec.clip.summaries] == [(w[0], w[-1]) for w in windows]
    for s, w in zip(rec.clip.summaries, windows):
        assert s.recommended_max_norm == pytest.approx(numpy_tau(steps, norms, w[0], w[-1]), rel=1e-12)
    assert len(rec.clip.drift()) == len(rec.clip.checks()) == 3


@pytest.mark.slow  # a 240-step training run
def test_a_runs_own_csv_gives_the_tau_the_run_calibrated(tmp_path):
    """A real AmpTrainState run with clip=calibrated (start=auto, LR warm-up, a token-count loss) writes steps.csv;
    the command on that CSV places the window, summarises it (‖g‖·√N_tok quantiles included) and checks the band
    exactly as the run's policy did."""
    import torch

    from clipamp_engine.csvlog import StepCSVWriter
    from clipamp_engine.step import AmpTrainState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=30)
    policy = CalibratedClip(40, start="auto", total_steps=240, spelling=RECOMMEND_SPELLING)  # its texts compared too

    def loss_fn(out, y):  # (loss_sum, token_count): the records carry token counts
        return ((out - y) ** 2).sum(), y.numel()

    state = AmpTrainState(model, opt, loss_fn, dtype="fp32", clip=policy, scheduler=warmup)
    writer = StepCSVWriter(tmp_path / "steps.csv")
    g = torch.Generator().manual_seed(1)
    logs = []
    for _ in range(240):
        x = torch.randn(32, 8, generator=g)
        logs.append(state.step(x, x.sum(1, keepdim=True).sin()))
        writer.write(logs[-1])
    writer.close()
    rec = parse([str(tmp_path / "steps.csv"), "--window", "40"])
    assert policy.placement.rule == "auto" and rec.clip.placement == policy.placement
    assert [s.as_state() for s in rec.clip.summaries] == [s.as_state() for s in policy.summaries]
    assert policy.summaries[0].token_quantiles  # compared above: the run's ‖g‖·√N_tok quantiles, not "—"
    assert rec.clip.checks() == policy.checks() and rec.tau == policy.tau
    assert rec.findings and rec.findings == diagnose(logs)  # the diagnosis a run's report prints


@pytest.mark.slow  # a 500-step training run
def test_defaults_are_the_runners(tmp_path, capsys):
    """With no option the command calibrates as ``+experiment=calibrate`` and the trainer integrations do
    (``RECOMMENDED``: a 200-step window placed after warm-up, τ aimed at the band's middle): on a real run's
    steps.csv it gives that run's window, τ and check."""
    import torch

    from clipamp_engine.clip.calibrated import recommended_calibration
    from clipamp_engine.csvlog import StepCSVWriter
    from clipamp_engine.step import AmpTrainState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=30)
    policy = recommended_calibration(total_steps=500, spelling=RECOMMEND_SPELLING)  # its texts compared too
    state = AmpTrainState(model, opt, torch.nn.functional.mse_loss, dtype="fp32", clip=policy, scheduler=warmup)
    g = torch.Generator().manual_seed(1)
    with StepCSVWriter(tmp_path / "steps.csv") as writer:
        for _ in range(500):
            x = torch.randn(32, 8, generator=g)
            writer.write(state.step(x, x.sum(1, keepdim=True).sin()))
    ns = cli.parser().parse_args([str(tmp_path / "steps.csv")])
    rec = cli.recommend(ns.paths[0], cli.options_from(ns), ns)
    [window] = policy.summaries
    assert window.end_step - window.start_step + 1 == 200 and policy.quantile == pytest.approx(0.97)
    assert [s.as_state() for s in rec.clip.summaries] == [window.as_state()]
    assert rec.clip.checks() == policy.checks() and rec.tau == policy.tau
    assert cli.main([str(tmp_path / "steps.csv")]) == 0
    assert f"max_grad_norm={policy.tau:.4g}" in capsys.readouterr().out


def test_tensorboard_event_file(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    steps, lr, norms = trace()
    writer = SummaryWriter(str(tmp_path / "tb"))
    for s, l, x in zip(steps.tolist(), lr.tolist(), norms.tolist()):
        writer.add_scalar("train/grad_norm", x, s)
        writer.add_scalar("train/learning_rate", l, s)
        writer.add_scalar("train/loss", 1.0, s)
    writer.close()
    assert main([str(tmp_path / "tb"), "--start", "100"]) == 0
    out = capsys.readouterr().out
    stored = norms.astype(np.float32).astype(np.float64)  # event files hold float32
    tau = numpy_tau(steps, stored, 101, 200)
    assert f"max_grad_norm={tau:.4g}" in out and "(TensorBoard): train/grad_norm, 400 values" in out
    assert parse([str(tmp_path / "tb"), "--start", "100"]).tau == pytest.approx(tau, rel=1e-12)
    assert "LR from train/learning_rate" in out


def test_mlflow_run_and_track(store, tmp_path, capsys):
    from mlflow.entities import Metric, Param

    steps, lr, norms = trace()
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("hf"))
    metrics = [Metric("grad_norm", float(x), 0, int(s)) for s, x in zip(steps, norms)]
    metrics += [Metric("learning_rate", float(v), 0, int(s)) for s, v in zip(steps, lr)]
    client.log_batch(run.info.run_id, metrics=metrics, params=[Param("max_grad_norm", "5.0")])
    argv = [f"runs:/{run.info.run_id}", "--tracking-uri", store, "--start", "100", "--track", "--experiment", "rec"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    tau = numpy_tau(steps, norms, 101, 200)
    assert "every logged norm is below the run's max_grad_norm (5)" in out
    (logged,) = client.search_runs([client.get_experiment_by_name("rec").experiment_id])
    assert logged.data.metrics["recommended_max_norm"] == pytest.approx(tau, rel=1e-12)
    assert logged.data.metrics["grad_norm_p95"] == logged.data.metrics["recommended_max_norm"]
    assert logged.data.params["calibrate.start"] == "100" and logged.data.tags["run"] == "recommend"
    bare = parse([run.info.run_id, "--tracking-uri", store, "--start", "100"])  # a run id without runs:/
    assert bare.tau == logged.data.metrics["recommended_max_norm"]
    names = {a.path for a in client.list_artifacts(logged.info.run_id)}
    assert names == {"report.md", "quantiles.json"} and f"MLflow run {logged.info.run_id}" in out
    client.delete_experiment(client.get_experiment_by_name("rec").experiment_id)
    assert main([*argv[:-1], "hf"]) == 0 and capsys.readouterr()  # into the user's own experiment: tags kept
    assert client.get_experiment_by_name("hf").tags == {}
    assert "--experiment 'rec' was deleted" in _error(capsys, argv)  # before any report is printed
    typo = tmp_path / "typo" / "mlflow.db"  # a mistyped store is said, not created
    message = _error(capsys, [f"runs:/{run.info.run_id}", "--tracking-uri", f"sqlite:///{typo}"])
    assert f"no tracking store at {typo}: pass --tracking-uri" in message and not typo.parent.exists()


def test_our_csv_skipped_steps_are_counted_not_mixed_in(tmp_path):
    steps, lr, norms = trace(300)
    norms[150] = math.inf
    skipped = ["True" if s == 151 else "False" for s in steps]
    cols = dict(zip(CANONICAL_COLUMNS, [steps, lr, norms, norms, np.ones(300), skipped, [""] * 300, np.ones(300)]))
    path = write_csv(tmp_path / "steps.csv", {**cols, "max_norm": [""] * 300})
    rec = parse([str(path), "--start", "100"])
    w = rec.clip.summaries[0]
    assert (w.n_finite, w.n_skipped) == (99, 1)
    assert rec.tau == pytest.approx(numpy_tau(steps[steps != 151], norms[steps != 151], 101, 200), rel=1e-12)
    assert "clipamp records grad_l2_pre_clip before clipping" in rec.notes[0]
    assert rec.findings and rec.findings[0].kind == "nonfinite"  # the diagnosis read our rows


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr()
    assert err.out == "" and len(err.err.splitlines()) == 1 and err.err.startswith("error: ")
    return err.err


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    steps, lr, norms = trace()
    assert "no such file or folder" in _error(capsys, [str(tmp_path / "missing.json")])
    short = _error(capsys, ["runs:/2ddd5d52"])  # an id cut short: not "no such file"
    report = python_command("sweep.report")
    assert short == f"error: runs:/2ddd5d52: a run id is 32 hex digits ({report} --wide lists them)\n"
    writer = SummaryWriter(str(tmp_path / "tb"))
    writer.add_scalar("train/loss", 1.0, 1)
    writer.close()
    assert "no gradient-norm tag" in _error(capsys, [str(tmp_path / "tb")])
    assert "no tag 'gn'" in _error(capsys, [str(tmp_path / "tb"), "--norm", "gn"])
    clipped = np.minimum(norms, 1.2)  # logged after clipping at 1.2
    post = write_csv(tmp_path / "post.csv", {"step": steps, "grad_norm": clipped})
    assert "sit at its maximum 1.2" in _error(capsys, [str(post)])
    msg = _error(capsys, [str(post), "--max-grad-norm", "1.2"])
    assert "every grad_norm is ≤ the run's max_grad_norm (1.2)" in msg
    cols = dict(zip(CANONICAL_COLUMNS, [steps, lr, norms, clipped, norms, ["False"] * N, [""] * N, norms]))
    ours = write_csv(tmp_path / "steps.csv", cols)
    assert "grad_l2_post_clip is the norm after clipping" in _error(capsys, [str(ours), "--norm", "grad_l2_post_clip"])
    short = write_csv(tmp_path / "short.csv", {"step": steps[:60], "grad_norm": norms[:60]})
    assert "60 finite norms over steps 1–60, fewer than one 100-step window holds (100)" in _error(capsys, [str(short)])
    few = write_csv(tmp_path / "few.csv", {"step": [1, 2, 3], "grad_norm": ["nan", "inf", 0.5]})
    assert "1 finite norm (2 more non-finite or skipped) over steps 1–3, fewer than" in _error(capsys, [str(few)])
    assert "--max-grad-norm 0: pass the τ > 0" in _error(capsys, [str(short), "--max-grad-norm", "0"])
    assert "--quantile x" in _error(capsys, [str(short), "--quantile", "x"])
    assert "--window 1 must be an integer >= 2" in _error(capsys, [str(ours), "--window", "1"])
    late = write_csv(tmp_path / "late.csv", {"step": steps + 100_000, "grad_norm": norms})  # a continued run's log
    message = _error(capsys, [str(late), "--start", "100"])
    assert "the 100-step window (steps 101–200) ends before the log's first step 100001: pass --start 100000" in message
    assert main([str(late), "--start", "100000"]) == 0  # the fix it names
    capsys.readouterr()
    # an option the engine refuses is named as the flag typed, not as the engine's argument
    assert (
        _error(capsys, [str(ours), "--every", "30", "--window", "100"])
        .rstrip()
        .endswith("--every 30 must be 0 (one window) or an integer >= --window 100")
    )
    assert "--target-clip 0.5 0.1 needs 0 <= low < high <= 1" in _error(
        capsys, [str(ours), "--target-clip", "0.5", "0.1"]
    )
    zeros = write_csv(tmp_path / "zeros.csv", {"step": steps, "grad_norm": np.zeros(N)})
    assert "every finite grad_norm is 0: the run's gradients were zero (a detached loss" in _error(capsys, [str(zeros)])
    negative = write_csv(tmp_path / "negative.csv", {"step": steps, "grad_norm": -norms})
    assert "grad_norm holds negative values (down to -" in _error(capsys, [str(negative)])


@pytest.mark.slow  # writes and reads 10 500 TensorBoard events
def test_every_event_is_read_past_tensorboards_10000_value_reservoir(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    rng = np.random.default_rng(5)
    norms = np.exp(rng.normal(0.0, 0.3, 10_500)).astype(np.float32).astype(np.float64)
    writer = SummaryWriter(str(tmp_path / "tb"))
    for s, x in enumerate(norms.tolist(), start=1):
        writer.add_scalar("grad_norm", x, s)
    writer.close()
    rec = parse([str(tmp_path / "tb"), "--start", "0", "--window", "10000"])
    assert len(rec.series.steps) == 10_500 and rec.clip.summaries[0].n_finite == 10_000
    assert rec.tau == pytest.approx(float(np.quantile(norms[:10_000], 0.95)), rel=1e-12)


def test_a_running_mean_is_flagged_and_per_step_norms_are_not(tmp_path):
    steps, lr, norms = trace()
    ema = np.empty_like(norms)
    ema[0] = norms[0]
    for i in range(1, len(norms)):
        ema[i] = 0.9 * ema[i - 1] + 0.1 * norms[i]
    raw = parse([str(write_csv(tmp_path / "raw.csv", {"step": steps, "lr": lr, "grad_norm": norms}))])
    smooth = parse([str(write_csv(tmp_path / "ema.csv", {"step": steps, "lr": lr, "grad_norm": ema}))])
    assert not any("changes smoothly" in n for n in raw.notes)
    assert any("changes smoothly" in n and "running mean" in n for n in smooth.notes)


def test_repeated_steps_keep_the_last_value_and_several_runs_are_refused(tmp_path, capsys):
    from torch.utils.tensorboard import SummaryWriter

    steps, lr, norms = trace()
    resumed = np.r_[steps, steps[200:]]  # a run resumed from step 200 logs steps 201.. again
    values = np.r_[norms * 10, norms[200:]]
    rec = parse([str(write_csv(tmp_path / "log.csv", {"step": resumed, "grad_norm": values})), "--start", "200"])
    assert "200 repeated step(s)" in rec.notes[-1]
    assert rec.tau == pytest.approx(numpy_tau(steps, np.r_[norms[:200] * 10, norms[200:]], 201, 300), rel=1e-12)
    for run in ("a", "b"):
        writer = SummaryWriter(str(tmp_path / "tb" / run))
        writer.add_scalar("grad_norm", 1.0, 1)
        writer.close()
    message = _error(capsys, [str(tmp_path / "tb")])
    assert "2 runs log grad_norm and b (steps 1–1) starts over" in message and "pass one of them" in message


def test_a_gap_at_the_windows_end_is_a_skipped_step_and_a_cut_window_says_so(tmp_path):
    steps, lr, norms = trace()
    path = write_csv(tmp_path / "log.csv", {"step": steps, "lr": lr, "grad_norm": norms}, keep=lambda r: r[0] != 200)
    rec = parse([str(path), "--start", "100"])
    w = rec.clip.summaries[0]
    assert (w.start_step, w.end_step, w.n_finite, w.n_skipped) == (101, 200, 99, 1)
    assert rec.tau == pytest.approx(numpy_tau(steps[steps != 200], norms[steps != 200], 101, 200), rel=1e-12)
    assert any("1 step(s) of the logging grid hold no value" in n for n in rec.notes)
    cut = parse([str(path), "--start", "350"])
    assert (cut.clip.summaries[0].start_step, cut.clip.summaries[0].end_step) == (351, 400)
    assert any("the window was cut at the log's end: steps 351–400 instead of 100" in n for n in cut.notes)
    assert any("no logged step after the window" in n for n in cut.notes)


def test_a_gap_in_a_log_with_token_counts_keeps_each_count_at_its_step(tmp_path):
    """A CSV with token_count and a step of its grid not logged: the counts stay on their steps (the window's
    ‖g‖·√N_tok quantiles are numpy's over those steps) and every step after the window is validated."""
    steps, lr, norms = trace()
    tokens = 1 + (steps * 7919) % 4096  # a count per step, so that one shifted by a step shows
    logged = steps != 150
    path = write_csv(
        tmp_path / "log.csv",
        {"step": steps, "lr": lr, "grad_norm": norms, "token_count": tokens},
        keep=lambda r: r[0] != 150,
    )
    rec = parse([str(path), "--start", "100"])
    w = rec.clip.summaries[0]
    assert (w.start_step, w.end_step, w.n_finite, w.n_skipped) == (101, 200, 99, 1)
    inside = logged & (steps >= 101) & (steps <= 200)
    assert w.token_quantiles["p95"] == pytest.approx(np.quantile(norms[inside] * np.sqrt(tokens[inside]), 0.95))
    assert rec.clip.checks()[0].steps == int((steps > 200).sum())  # to the log's last step


def test_console_script_runs_the_same_cli(tmp_path, monkeypatch, capsys):
    import importlib
    import tomllib

    from tests.app.helpers import REPO

    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["clipamp-recommend"]
    module, _, name = target.partition(":")
    script = getattr(importlib.import_module(module), name)
    monkeypatch.setattr("sys.argv", ["clipamp-recommend", str(tmp_path / "none.csv")])
    with pytest.raises(SystemExit) as e:
        script()
    assert e.value.code == 2 and "no such file or folder" in capsys.readouterr().err


def test_tensor_style_scalars_are_read_too(tmp_path):
    """TF2-style summaries (``new_style``) keep scalars as tensors: EventAccumulator lists them under tensors."""
    from torch.utils.tensorboard import SummaryWriter

    steps, lr, norms = trace(300)
    writer = SummaryWriter(str(tmp_path / "tb"))
    for s, x in zip(steps.tolist(), norms.tolist()):
        writer.add_scalar("grad_norm", x, s, new_style=True)
    writer.close()
    rec = parse([str(tmp_path / "tb"), "--start", "50"])
    stored = norms.astype(np.float32).astype(np.float64)
    assert rec.tau == pytest.approx(numpy_tau(steps, stored, 51, 150), rel=1e-12)
    assert any("no learning rate in the log" in n for n in parse([str(tmp_path / "tb")]).notes)


def test_rows_that_log_other_metrics_leave_the_norm_blank_and_are_not_skipped_steps(tmp_path):
    """Lightning's CSVLogger writes a validation row at the step of a training row with the norm cell blank:
    it is no value of the norm (a logged "nan" is), so it neither replaces that step's norm nor counts as a skip."""
    steps, lr, norms = trace()
    path = tmp_path / "metrics.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "grad_2.0_norm_total", "lr", "step", "val_loss"])
        for s, l, n in zip(steps, lr, norms):
            w.writerow([0, repr(float(n)), repr(float(l)), s - 1, ""])  # Lightning's step: global_step, 0-based
            if s % 10 == 0:
                w.writerow([0, "", "", s - 1, "1.5"])  # validation: same step, other metrics
        w.writerow([0, "nan", "", N, ""])  # a logged non-finite norm stays a skipped step
    rec = parse([str(path), "--start", "60", "--window", "120"])
    w = rec.clip.summaries[0]
    assert (w.start_step, w.end_step, w.n_finite, w.n_skipped) == (61, 180, 120, 0)
    assert rec.tau == pytest.approx(numpy_tau(steps, norms, 61, 180), rel=1e-12)
    assert not any("repeated step" in note for note in rec.notes)
    assert rec.series.steps.tolist() == [*steps, N + 1] and math.isnan(rec.series.norms[-1])


def lightning_csv(path, steps, lr, norms, lr_name="lr-AdamW"):
    """Lightning's CSVLogger layout: LearningRateMonitor's LR on a row of its own, the norm on the next, at
    Lightning's step numbers (``global_step`` before the update: optimizer step k as k − 1)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["epoch", "grad_2.0_norm_total", lr_name, "step"])
        for s, l, n in zip(steps, lr, norms):
            w.writerow(["", "", repr(float(l)), s - 1])
            w.writerow([0, repr(float(n)), "", s - 1])
    return path


def test_an_lr_logged_on_rows_of_its_own_is_joined_to_the_norm_by_step(tmp_path, capsys):
    """LearningRateMonitor's rows leave the norm blank: the LR is read from them, so --start auto sees the warm-up
    the merged log shows (the engine's placement on the same trace) and τ is numpy's over that window."""
    steps, lr, norms = trace()
    rec = parse([str(lightning_csv(tmp_path / "metrics.csv", steps, lr, norms)), "--lr", "lr-AdamW"])
    placement = auto_window_start(zip(steps.tolist(), lr.tolist(), norms.tolist()), latest=N - 100 - 100 + 1)
    assert placement.warmup_end == 51 and rec.clip.placement == placement
    assert np.array_equal(rec.series.lrs, lr)
    start = placement.start
    assert rec.tau == pytest.approx(numpy_tau(steps, norms, start, start + 99), rel=1e-12)
    merged = write_csv(tmp_path / "merged.csv", {"step": steps, "lr-AdamW": lr, "grad_2.0_norm_total": norms})
    assert parse([str(merged), "--lr", "lr-AdamW"]).tau == rec.tau


def test_learning_rate_monitors_default_names_are_the_lr(tmp_path, capsys):
    """LearningRateMonitor names the LR lr-<Optimizer> (lr-<Optimizer>/pgK per param group): taken by default,
    the first group's where several, so the placement is the engine's on the logged warm-up with no --lr."""
    from sweep.recommend.readers import lightning_lr

    steps, lr, norms = trace()
    placement = auto_window_start(zip(steps.tolist(), lr.tolist(), norms.tolist()), latest=N - 100 - 100 + 1)
    for name in ("lr-AdamW", "lr-SGD"):
        rec = parse([str(lightning_csv(tmp_path / f"{name}.csv", steps, lr, norms, name))])
        assert rec.series.lr_name == name and rec.clip.placement == placement
        assert rec.tau == pytest.approx(numpy_tau(steps, norms, placement.start, placement.start + 99), rel=1e-12)
    groups = write_csv(
        tmp_path / "groups.csv",
        {
            "step": steps,
            "grad_2.0_norm_total": norms,
            "lr-AdamW/pg1": lr,
            "lr-AdamW/pg2": np.full(N, 1e-4),  # a constant LR: no warm-up to see
            "lr-AdamW/pg1-momentum": np.full(N, 0.9),
        },
    )
    rec = parse([str(groups)])
    assert rec.series.lr_name == "lr-AdamW/pg1" and rec.clip.placement == placement
    assert lightning_lr(["lr-AdamW", "lr-AdamW-momentum", "lr-AdamW-weight_decay"]) == "lr-AdamW"
    assert lightning_lr(["lr-AdamW", "lr-SGD"]) is None  # two optimizers: --lr says which
    assert main([str(groups)]) == 0 and "LR from lr-AdamW/pg1" in capsys.readouterr().out


def test_the_pieces_of_a_resumed_run_are_merged_by_step(tmp_path, capsys):
    """HF resumed from a checkpoint writes a second run folder that starts inside the first one's steps: the pieces
    (ordered by wall time, not folder name) merge by step, the later one's values replacing the earlier's from its
    first step on; τ is the merged CSV's. One piece alone says it starts mid-run."""
    import time

    from torch.utils.tensorboard import SummaryWriter

    steps, lr, norms = trace()
    for run, part, scale in (("z_first", steps <= 250, 10.0), ("a_resumed", steps > 200, 1.0)):
        writer = SummaryWriter(str(tmp_path / "runs" / run))
        for s, l, x in zip(steps[part].tolist(), lr[part].tolist(), (norms[part] * scale).tolist()):
            writer.add_scalar("train/grad_norm", x, s)
            writer.add_scalar("train/learning_rate", l, s)
        writer.close()
        time.sleep(0.05)
    merged = np.r_[norms[:200] * 10, norms[200:]].astype(np.float32).astype(np.float64)  # event files hold float32
    rec = parse([str(tmp_path / "runs"), "--start", "150"])
    assert rec.series.steps.tolist() == steps.tolist() and np.array_equal(rec.series.norms, merged)
    csv_rec = parse(
        [str(write_csv(tmp_path / "m.csv", {"step": steps, "lr": lr, "grad_norm": merged})), "--start", "150"]
    )
    assert rec.tau == csv_rec.tau == pytest.approx(numpy_tau(steps, merged, 151, 250), rel=1e-12)
    assert any(
        "2 runs log train/grad_norm as pieces of one resumed run (z_first: steps 1–250, a_resumed" in n
        for n in rec.notes
    )
    piece = parse([str(tmp_path / "runs" / "a_resumed")])
    assert any("the log starts at step 201: steps before it are not in it" in n for n in piece.notes)
    assert not any("the log starts at step" in n for n in rec.notes)


def test_a_sampled_per_step_series_with_a_warmup_is_not_read_as_a_running_mean(tmp_path):
    """Every 10th of per-step norms decaying 9× over a warm-up (30 points, as HF logging_steps=10 logs them) is no
    running mean; a 10-step mean or an EMA of the same per-step norms is, and still warns."""
    import pandas as pd

    from sweep.recommend.series import smoothing_note

    rng = np.random.default_rng(5)
    steps = np.arange(1, 301)
    norms = np.exp(rng.normal(0.0, 0.3, 300)) * (1 + 8 * np.exp(-steps / 40))
    sampled = parse(
        [str(write_csv(tmp_path / "s.csv", {"step": steps[9::10], "grad_norm": norms[9::10]})), "--window", "100"]
    )
    assert not any("changes smoothly" in n for n in sampled.notes)
    assert sampled.series.interval == 10
    for smooth in (pd.Series(norms).rolling(10, min_periods=1).mean(), pd.Series(norms).ewm(alpha=0.1).mean()):
        rec = parse([str(write_csv(tmp_path / "m.csv", {"step": steps, "grad_norm": smooth.to_numpy()}))])
        assert "running mean" in smoothing_note(rec.series)


def test_the_advice_for_a_log_names_this_commands_flags(tmp_path, capsys):
    """A 300-step log and the default 200-step window: the placement's advice names what the user of this
    command changes (a longer log, ``--start``), never the app's overrides (``calibrate.start=``, ``steps``)."""
    steps, lr, norms = trace(300)
    path = write_csv(tmp_path / "log.csv", {"step": steps, "lr": lr, "grad_norm": norms})
    assert cli.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "window placement (--start auto): " in out and "raise the log's length to let --start auto wait" in out
    assert "calibrate." not in out and "raise steps" not in out
