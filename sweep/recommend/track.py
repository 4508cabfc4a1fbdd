"""``--track``: a recommendation as an MLflow run, named like a calibrate run's records.

Metrics ``recommended_max_norm`` and ``grad_norm_p50/p90/p95/p99`` (the first window's), the window's
intervals, prediction and band check (``sweep.run.calibration.calibration_metrics``), and
``norms_logged``; artifacts ``report.md`` (``sweep.recommend.report.markdown``) and ``quantiles.json``
(``calibration_payload``); params: the source, the norm read, its logging interval and every
calibration option (``calibrate.*``).
"""

from __future__ import annotations

import math
import time

from sweep.recommend.report import Recommendation, markdown
from sweep.run.calibration import calibration_metrics, calibration_payload
from sweep.tracking.tracker import ensure_experiment, open_client, resolve_uri


def open_store(tracking_uri: str | None, experiment: str) -> tuple[object, str]:
    """The client on the store ``--tracking-uri`` (else ``$MLFLOW_TRACKING_URI``, else the default store)
    names and the id of ``experiment`` there (created if missing, with the tags that open the MLflow UI on
    clipamp's columns; ``clipamp`` gets them, another that exists is the user's and keeps its own); an
    unreachable store or a deleted experiment is a ``UserError`` (``open_client``, ``ensure_experiment``),
    before anything is printed."""
    uri = resolve_uri(tracking_uri)
    client = open_client(uri)
    return client, ensure_experiment(client, experiment, uri, retag=experiment == "clipamp")


def log_recommendation(client, experiment_id: str, rec: Recommendation) -> str:
    """One finished run in ``experiment_id`` holding ``rec``; its id."""
    from mlflow.entities import Metric, Param

    s, o, first = rec.series, rec.options, rec.clip.summaries[0]
    exp = experiment_id
    run = client.create_run(
        exp,
        run_name=f"recommend-{s.name.replace('/', '_')}",
        tags={"run": "recommend", "clip": "calibrated", "source": s.source, "norm": s.name},
    )
    run_id = run.info.run_id
    metrics = {
        "recommended_max_norm": rec.tau,
        **{f"grad_norm_{k}": v for k, v in first.quantiles.items() if k != "max"},
        **calibration_metrics(rec.clip),
        "norms_logged": float(s.taken.sum()),
    }
    params = {
        "source": s.source,
        "norm": s.name,
        "log_interval": s.interval,
        "calibrate.window": o.window,
        "calibrate.every": o.every,
        "calibrate.quantile": rec.clip.quantile,
        "calibrate.start": o.start,
        "calibrate.validate": o.validate,
        "calibrate.target_clip": list(o.target_clip),
        "calibrate.candidates": list(o.candidates),
        "calibrate.confidence": o.confidence,
    }
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items() if math.isfinite(v)],
        params=[Param(k, str(v)[:500]) for k, v in params.items()],
    )
    client.log_text(run_id, markdown(rec), "report.md")
    client.log_dict(run_id, calibration_payload(rec.clip), "quantiles.json")
    client.set_terminated(run_id)
    return run_id
