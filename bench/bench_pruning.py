"""Pruning of the constrained sweep: trial steps saved, and the pick with and without pruning.

    python bench/bench_pruning.py [--seeds 0 1 2] [--goal 0.4] [--keep DIR] [-- KEY=VALUE ...]

For each seed it runs the default constrained sweep (``python -m sweep +experiment=sweep
study=constrained seed=S``) twice, each in a fresh temporary folder with its own MLflow and Optuna
stores: with the study's pruner, and with ``study.pruner=none``. The trial steps are counted from the
Optuna study itself (each trial's ``steps_run`` attribute, the optimizer steps its run recorded; a
pruned trial's last reported step is checked against it), the pick is recomputed from the study with
the app's rule (``sweep.pick.pick_trial``). Prints, per seed, the trial steps with and without
pruning, the saving, both picks and whether they are the same trial with the same parameters; exit
status 1 when a seed saves less than ``--goal`` or changes the pick. KEY=VALUE after ``--`` go to
both sweeps of every seed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402

from sweep.pick import pick_trial  # noqa: E402
from sweep.results.study import trials_table  # noqa: E402


def run_sweep(folder: Path, seed: int, extra: list[str]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "sweep",
        "+experiment=sweep",
        "study=constrained",
        f"seed={seed}",
        "progress=false",
        "tracking.plots=false",
        f"tracking.uri=sqlite:///{folder}/mlruns/mlflow.db",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"sweep failed ({' '.join(cmd[3:])}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def study_figures(folder: Path) -> dict:
    """Trial steps (from each trial's ``steps_run``), pruned count and the pick, read from the Optuna study."""
    storage = f"sqlite:///{folder}/mlruns/optuna.db"
    (summary,) = optuna.get_all_study_summaries(storage, include_best_trial=False)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    steps = 0
    for t in trials:
        ran = int(t.user_attrs["steps_run"])
        if t.state == optuna.trial.TrialState.PRUNED and t.intermediate_values:
            assert max(t.intermediate_values) <= ran, (t.number, t.intermediate_values, ran)
        steps += ran
    band = tuple(study.user_attrs["task"]["space"]["band"])
    pick = pick_trial(trials_table(study, band), band)
    pruned = sum(t.state == optuna.trial.TrialState.PRUNED for t in trials)
    return {"steps": steps, "trials": len(trials), "pruned": pruned, "pick": pick}


def shown(pick) -> str:
    return "none" if pick is None else f"#{pick.trial} {pick.dtype} max_norm={pick.max_norm:.6g}"


def same(a, b) -> bool:
    return a is not None and b is not None and (a.trial, a.dtype, a.max_norm) == (b.trial, b.dtype, b.max_norm)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--goal", type=float, default=0.4, help="the saving each seed must reach")
    ap.add_argument("--keep", type=Path, help="keep the sweeps' folders under DIR (default: deleted)")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    ok = True
    head = f"{'seed':>4}  {'steps pruned':>12}  {'unpruned':>8}  {'saved':>6}  {'pruned':>6}  same pick"
    print(f"{head}  picks (pruned | unpruned)")
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with nullcontext(str(args.keep.resolve())) if args.keep else tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            figs = {}
            for arm, overrides in (("pruned", []), ("unpruned", ["study.pruner=none"])):
                folder = Path(tmp) / f"seed{seed}-{arm}"
                folder.mkdir(exist_ok=False)
                run_sweep(folder, seed, extra + overrides)
                figs[arm] = study_figures(folder)
            p, u = figs["pruned"], figs["unpruned"]
            saving = 1 - p["steps"] / u["steps"]
            agree = same(p["pick"], u["pick"])
            ok &= agree and saving >= args.goal
            print(
                f"{seed:>4}  {p['steps']:>12}  {u['steps']:>8}  {saving:>6.1%}  {p['pruned']:>2}/{p['trials']:<3}  "
                f"{'yes' if agree else 'NO':>9}  {shown(p['pick'])} | {shown(u['pick'])}"
            )
    print(f"every seed saves >= {args.goal:.0%} with the same pick: {'yes' if ok else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
