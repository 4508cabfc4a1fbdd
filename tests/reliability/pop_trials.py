"""One sweep worker's share of a study's queue: ``python pop_trials.py URL START N``.

Opens the Optuna storage at URL as the app does (``open_storage``), waits until ``time.time()`` is
START (the workers begin together), then asks and tells N trials and prints the trial numbers it
got as JSON (an error ends it with a traceback and exit 1).
"""

from __future__ import annotations

import json
import sys
import time

import optuna
from optuna.distributions import FloatDistribution

from sweep.experiments.study.storage import open_storage


def main(url: str, start: float, n: int) -> None:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.load_study(study_name="queue", storage=open_storage(url))
    while time.time() < start:
        time.sleep(0.001)
    got = []
    for _ in range(n):
        trial = study.ask({"x": FloatDistribution(0, 1000)})
        got.append(trial.number)
        study.tell(trial, trial.params["x"])
    print(json.dumps(got))


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
