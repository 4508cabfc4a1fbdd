"""``python -m sweep.resend DIR [--tracking-uri URI]``: send what a run kept while its tracking server
was away (``sweep.tracking.outbox``): its metric values, tags, artifacts and its end (FINISHED/KILLED/FAILED).

``DIR`` is the folder the run's warning named (it holds ``pending.json`` and the artifacts). The
server is ``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else the one the run used (its password,
if any, is not kept: pass it again). Once everything is sent the folder is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from sweep.errors import UserError, fail, one_line
from sweep.offline import stay_offline
from sweep.tracking.outbox import PENDING, read_pending
from sweep.tracking.tracker import open_client, own_run_lines, redact

DESCRIPTION = (
    "Send what a run kept while its tracking server was away: its metric values, tags, artifacts and its "
    "end (FINISHED/KILLED/FAILED). Once everything is sent the folder is removed."
)


def main(argv: list[str] | None = None) -> int:
    stay_offline()
    own_run_lines()
    ap = argparse.ArgumentParser(prog="python -m sweep.resend", description=DESCRIPTION)
    ap.add_argument("folder", type=Path, help="the run's local folder named by the warning (holds pending.json)")
    ap.add_argument(
        "--tracking-uri",
        default=None,
        help="the MLflow server (default: $MLFLOW_TRACKING_URI, else the run's; its password is not kept: pass it)",
    )
    args = ap.parse_args(argv)
    pending = args.folder / PENDING
    if not pending.is_file():
        fail(f"{pending} does not exist: pass the folder that the run's warning named")
    try:
        uri = (
            args.tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or json.loads(pending.read_text())["tracking_uri"]
        )
        client = open_client(uri)
        box, status = read_pending(args.folder, client, say=lambda line: None)
        count = len(box.metrics)
        if not box.close(status, args.folder, wait_s=0):
            fail(f"the tracking server {redact(uri)} still does not answer; nothing was lost: try again later", 1)
    except UserError as e:
        fail(str(e))
    except (ValueError, KeyError, TypeError) as e:
        fail(f"{pending} cannot be read ({one_line(e)}); it is written by a run whose server was away")
    shutil.rmtree(args.folder)
    print(
        f"sent {count} metric values, the artifacts and the end ({status}) of run {box.run_id} to {redact(uri)}; "
        f"removed {args.folder}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
