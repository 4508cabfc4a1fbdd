"""``python -m tests.reliability.paused_sweep PHASE ARGS``: ``python -m sweep ARGS`` with one phase of the
sweep held for a second, after touching ``$CLIPAMP_TEST_MARKER``: a signal sent once the marker exists
lands in that phase. PHASE: ``recovery`` (before any trial), ``last-trial-end`` (the last trial's
end-of-run phase), ``report`` (the parent run's report, every trial ended), ``summary`` (the table
printed after the parent run ended)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _held(real, when=lambda *a: True):
    def held(*args, **kwargs):
        if when(*args):
            Path(os.environ["CLIPAMP_TEST_MARKER"]).touch()
            time.sleep(1.0)  # a signal's handler runs meanwhile; a deferred one is taken after the phase
        return real(*args, **kwargs)

    return held


def _last_trial(cfg, tracker, result) -> bool:
    return tracker.run_name.startswith(f"trial-{int(os.environ['CLIPAMP_TEST_TRIALS']) - 1}-")


PHASES = {
    "recovery": "recover_dead_workers",
    "last-trial-end": "write_run_report",
    "report": "write_sweep_report",
    "summary": "print_sweep_summary",
}

if __name__ == "__main__":
    from sweep.offline import stay_offline

    stay_offline()  # as the CLI does, before MLflow is imported
    from sweep.experiments.study import sweep as study_sweep

    phase = sys.argv.pop(1)
    name = PHASES[phase]
    when = _last_trial if phase == "last-trial-end" else (lambda *a: True)
    setattr(study_sweep, name, _held(getattr(study_sweep, name), when))
    from sweep.__main__ import cli

    cli()
