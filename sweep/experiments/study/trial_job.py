"""``torchrun … -m sweep.experiments.study.trial_job JOB.json``: one sweep trial on every rank.

Written and launched by ``trial_launch.run_job``: JOB.json holds the trial's config (as YAML), its
child run's name, parent and tags, and where rank 0 writes the outcome (ok + run id, a user
mistake, a failed rank's one line, an interruption) for the sweep process to read.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from sweep.config.convert import from_yaml
from sweep.config.schema import forensics_on
from sweep.distributed import launch as ranks
from sweep.distributed.rank_failure import RankFailed
from sweep.errors import UserError, fail, one_line_warnings
from sweep.report.run import write_run_report
from sweep.run.pipeline import RunHooks, RunResult, RunSpec, run_training
from sweep.secrets import redact_text, unseal
from sweep.tracking.tracker import open_store


def run(job: dict[str, Any]) -> RunResult:
    """Join torchrun's ranks and train the trial's config as its child run (rank 0 records)."""
    cfg = from_yaml(job["config"])
    cfg.tracking.uri = job["uri"]
    launch = ranks.start(
        cfg.dist.strategy,
        "train",
        cfg.data.batch_size,
        cfg.device,
        cfg.dist.timeout_s,
        cfg.clip.mode,
        forensics_on(cfg.forensics),
    )

    def go() -> RunResult:
        store = dataclasses.replace(open_store(cfg, None, launch, Path.cwd()), tags=job["store_tags"])
        spec = RunSpec(job["name"], job["parent_run_id"], job["tags"])
        return run_training(cfg, store, spec, RunHooks(artifacts=write_run_report, announce=lambda line: None), launch)

    return launch.run(go)


def main(argv: list[str]) -> None:
    one_line_warnings()
    job = json.loads(unseal(Path(argv[0]).read_text()))
    rank, status = ranks.rank_from_env(), 0
    try:
        outcome: dict[str, Any] = {"kind": "ok", "run_id": run(job).run_id}
    except UserError as e:
        outcome, status = {"kind": "user", "line": redact_text(" ".join(str(e).split()))}, 2
    except RankFailed as e:
        outcome, status = {"kind": "failed", "line": redact_text(e.line())}, 1
        line = e.report(rank)
        if line is not None:
            print(f"error: {redact_text(line)}", file=sys.stderr)
    except KeyboardInterrupt as e:
        outcome, status = {"kind": "interrupted", "line": f"trial job interrupted ({e})"}, 130
    if rank == 0:
        Path(job["outcome"]).write_text(json.dumps(outcome))
    if status == 2:
        fail(outcome["line"])
    sys.exit(status)


if __name__ == "__main__":
    main(sys.argv[1:])
