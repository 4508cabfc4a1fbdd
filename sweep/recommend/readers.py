"""Read a gradient-norm series from the logs a run already wrote.

- a Hugging Face ``Trainer`` ``trainer_state.json`` (or a checkpoint folder holding one, or an
  ``output_dir`` of ``checkpoint-N`` folders: the newest), whose ``log_history`` carries ``grad_norm``
  and ``learning_rate`` at every logging step;
- a TensorBoard event file or folder (``tensorboard``'s own ``EventAccumulator``, every value kept:
  its default keeps a reservoir sample of 10 000 scalars per tag);
- a CSV with a step and a norm column (clipamp's ``steps.csv`` among them);
- an MLflow run, ``runs:/ID`` or a run id (``MlflowClient.get_metric_history``).

A norm name, when not given, is the first of ``NORM_NAMES`` the log holds; the learning rate likewise
from ``LR_NAMES``, else Lightning's ``LearningRateMonitor`` name ``lr-<Optimizer>`` (``lightning_lr``).
Every failure is a ``UserError`` naming what was found and the option that fixes it.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

from clipamp_engine.records import CANONICAL_COLUMNS
from sweep.commands import python_command
from sweep.errors import UserError, one_line
from sweep.recommend.events import event_files, framing_problem, not_resumed, span
from sweep.recommend.folders import csv_in
from sweep.recommend.run_config import csv_run, own_settings, run_length, run_params
from sweep.recommend.series import NormSeries, lightning_marks, make_series, text_cells

#: Default norm names, in order: clipamp, Hugging Face (trainer_state, MLflow), HF's TensorBoard callback,
#: Lightning's ``grad_norm(module, norm_type=2)`` utility (logged from ``on_before_optimizer_step``).
NORM_NAMES = ("grad_l2_pre_clip", "grad_norm", "train/grad_norm", "grad_2.0_norm_total")
LR_NAMES = ("lr", "learning_rate", "train/learning_rate")
#: Step columns, in order: clipamp, Lightning's CSVLogger, HF exports, W&B's chart export, nanoGPT-style loops;
#: else the one column named ``…/global_step`` (W&B's run history of HF: ``train/global_step``).
STEP_NAMES = ("step", "global_step", "Step", "iteration", "iter")
HF_PRE_CLIP = (
    "Trainer logs grad_norm before clipping (the total norm clip_grad_norm_ returns), that step's own value "
    "(not a mean over the logging interval, unlike loss)"
)
RUN_ID = re.compile(r"(?:runs:/)?([0-9a-f]{32})(?:/.*)?")


def read_series(
    path: str,
    *,
    norm: str | None = None,
    lr: str | None = None,
    step: str | None = None,
    tracking_uri: str | None = None,
) -> NormSeries:
    """The norm series at ``path`` (module docstring for the sources it recognises)."""
    p = Path(path)
    run = RUN_ID.fullmatch(path)
    if run and (path.startswith("runs:/") or not p.exists()):
        return read_mlflow(run.group(1), norm=norm, lr=lr, tracking_uri=tracking_uri)
    if path.startswith("runs:/"):
        raise UserError(f"{path}: a run id is 32 hex digits ({python_command('sweep.report')} --wide lists them)")
    if not p.exists():
        raise UserError(f"{path}: no such file or folder (pass a trainer_state.json, an event file, a CSV or runs:/ID)")
    if p.is_dir():
        if (p / "trainer_state.json").is_file():
            return read_trainer_state(p / "trainer_state.json", norm=norm, lr=lr)
        checkpoints = sorted(p.glob("checkpoint-*/trainer_state.json"), key=lambda f: _number(f.parent.name))
        if checkpoints:
            return read_trainer_state(checkpoints[-1], norm=norm, lr=lr)
        if next(p.rglob("*tfevents*"), None) is not None:
            return read_tensorboard(p, norm=norm, lr=lr)
        return read_csv(csv_in(p), norm=norm, lr=lr, step=step)  # Lightning's CSVLogger folder version_N/
    if "tfevents" in p.name:
        return read_tensorboard(p, norm=norm, lr=lr)
    if p.suffix == ".json":
        return read_trainer_state(p, norm=norm, lr=lr)
    if p.suffix in (".csv", ".tsv"):
        return read_csv(p, norm=norm, lr=lr, step=step)
    raise UserError(
        f"{path}: not a log this reads (trainer_state.json, *.tfevents.*, *.csv, runs:/ID): "
        "rename it or pass its folder"
    )


def _number(name: str) -> int:
    digits = re.sub(r"\D", "", name)
    return int(digits) if digits else -1


def pick(available, wanted: str | None, names: tuple[str, ...], what: str, where: str, flag: str) -> str | None:
    """``wanted`` if ``available`` holds it (else a ``UserError`` listing them), else the first of ``names``
    held, else the one name ending in ``/<names[1]>`` (``grad_norm``, ``learning_rate``), else ``None``."""
    available = list(available)
    if wanted is not None:
        if wanted not in available:
            raise UserError(f"{where}: no {what} {wanted!r} (it holds {_listing(available)}): pass {flag} NAME")
        return wanted
    found = next((n for n in names if n in available), None)
    if found is None:
        ends = [a for a in available if a.endswith("/" + names[1])]
        found = ends[0] if len(ends) == 1 else None
    if found is None and names == LR_NAMES:
        found = lightning_lr(available)
    return found


def lightning_lr(available) -> str | None:
    """Lightning's ``LearningRateMonitor`` name of the LR: ``lr-<Optimizer>`` when one optimizer logs it, its
    first param group's (``lr-<Optimizer>/pg1``) when it logs several; ``None`` for several optimizers
    (``lr-AdamW``, ``lr-SGD``) or none. Its ``…-momentum`` and ``…-weight_decay`` are no LR."""
    names = [a for a in available if a.startswith("lr-") and not a.endswith(("-momentum", "-weight_decay"))]
    if len({n.split("/")[0] for n in names}) != 1:
        return None
    if len(names) == 1:
        return names[0]
    base = names[0].split("/")[0]
    return next((n for n in (base, base + "/pg1") if n in names), None)


def by_step(steps, values, at) -> np.ndarray:
    """``values`` logged at ``steps``, looked up at each step of ``at`` (the last value logged at a step
    wins; NaN where none was): a metric logged on rows or events of its own joined to the norm's steps."""
    joined = pd.Series(np.asarray(values, dtype=np.float64), index=np.asarray(steps)).groupby(level=0).last()
    return joined.reindex(np.asarray(at)).to_numpy()


def _listing(names: list[str], limit: int = 12) -> str:
    if not names:
        return "nothing"
    return ", ".join(names[:limit]) + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


def _need(found: str | None, available, what: str, where: str, flag: str) -> str:
    if found is None:
        raise UserError(
            f"{where}: no gradient-norm {what} ({' / '.join(NORM_NAMES)}; it holds {_listing(list(available))}): "
            f"pass {flag} NAME"
        )
    return found


def read_trainer_state(path: Path, *, norm: str | None = None, lr: str | None = None) -> NormSeries:
    """``log_history`` of a ``Trainer`` state: its entries with the norm key (evaluation entries have none)."""
    try:
        state = json.loads(Path(path).read_text())
        history = state["log_history"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a Trainer state with a log_history ({one_line(e)})") from None
    keys = sorted({k for h in history for k in h if k not in ("step", "epoch")})
    name = _need(pick(keys, norm, NORM_NAMES, "key", str(path), "--norm"), keys, "key", str(path), "--norm")
    rows = [h for h in history if name in h and "step" in h]
    lr_name = pick(keys, lr, LR_NAMES, "key", str(path), "--lr")
    lrs = [h.get(lr_name, np.nan) for h in rows] if lr_name else None
    series = make_series(
        f"{path} (Trainer state)",
        name,
        [h["step"] for h in rows],
        [np.nan if h[name] is None else h[name] for h in rows],
        lrs,
        pre_clip=HF_PRE_CLIP if name == "grad_norm" else None,
        lr_name=lr_name,
    )
    if n := state.get("logging_steps"):  # logging_strategy="epoch" logs at each epoch's end, whatever it says
        off = "" if n == series.interval else f", not the log's interval: its norms are {series.interval} steps apart"
        series.notes.append(f"Trainer logging_steps={n} (from the state){off}")
    planned = state.get("max_steps")
    if isinstance(planned, int) and not isinstance(planned, bool) and planned > int(series.steps[-1]):
        series.total_steps = planned  # a checkpoint taken mid-run: the live callback saw the run's end
        series.notes.append(
            f"the run's max_steps={planned} (from the state; the log ends at step {int(series.steps[-1])}): the "
            "window is placed for a run of that length, as the live run placed it"
        )
    return series


def _event_runs(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted({f.parent for f in path.rglob("*tfevents*") if f.is_file()})


def _load_events(run: Path) -> tuple[object, list[str]]:
    """The run's accumulator, and a note per event file that is not whole (``framing_problem``); a run whose
    files hold no tag and one of them torn or foreign is a ``UserError`` saying so, not an empty log."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(run), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    try:
        acc.Reload()
    except Exception as e:  # a torn or foreign file: the reader's own error names it
        raise UserError(f"{run}: unreadable TensorBoard events ({one_line(e)})") from None
    files = [run] if run.is_file() else sorted(f for f in run.glob("*tfevents*") if f.is_file())
    torn = [(f, *framing_problem(f)) for f in files]
    torn = [(f, n, problem) for f, n, problem in torn if problem]
    tags = acc.Tags()
    if torn and not (tags["scalars"] or tags.get("tensors")):
        f, n, problem = torn[0]
        raise UserError(
            f"{f}: unreadable TensorBoard events: the file {problem}"
            + (f", after {n} whole record(s) and no scalar (torn)" if n else "")
            + ": pass a whole event file"
        )
    notes = [
        f"{f.name} {problem}, after {n} whole records: TensorBoard's reader stops there, so the events after it "
        f"are not read (the file was cut short, or its run is still writing it)"
        for f, n, problem in torn
    ]
    return acc, notes


def _event_values(acc, tag: str) -> tuple[list[int], list[float]]:
    from tensorboard.util.tensor_util import make_ndarray

    if tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        return [e.step for e in events], [e.value for e in events]
    events = acc.Tensors(tag)  # TF2-style summaries keep scalars as tensors
    return [e.step for e in events], [float(make_ndarray(e.tensor_proto)) for e in events]


def read_tensorboard(path: Path, *, norm: str | None = None, lr: str | None = None) -> NormSeries:
    """The norm tag of the one run (folder of event files) under ``path`` that logs it."""
    found, torn = [], {}
    for run in _event_runs(Path(path)):
        acc, torn[run] = _load_events(run)
        tags = acc.Tags()
        names = sorted({*tags["scalars"], *tags.get("tensors", [])})
        name = pick(names, norm, NORM_NAMES, "tag", str(run), "--norm") if norm is None or norm in names else None
        found.append((run, acc, names, name))
    hits = [f for f in found if f[3] is not None]
    if not hits:
        names = sorted({n for *_, ns, _ in found for n in ns})
        if norm is not None:
            raise UserError(f"{path}: no tag {norm!r} (it holds {_listing(names)}): pass --norm TAG")
        _need(None, names, "tag", str(path), "--norm")
    pieces = [_piece(run, acc, names, name, lr) for run, acc, names, name in hits]
    name = hits[0][3]
    if len(hits) > 1 and (why := not_resumed(pieces, name)):
        runs = ", ".join(f"{p['run']} ({span(p)}: {event_files(p['run'])})" for p in pieces)
        raise UserError(f"{path}: {len(hits)} runs log {name}{why}: pass one of them ({runs})")
    pieces.sort(key=lambda p: p["wall"])
    steps, norms, lrs = pieces[0]["steps"], pieces[0]["norms"], pieces[0]["lrs"]
    for p in pieces[1:]:  # a resumed piece replaces what the earlier ones logged from its first step on
        before = steps < p["steps"].min()
        steps, norms = np.r_[steps[before], p["steps"]], np.r_[norms[before], p["norms"]]
        lrs = np.r_[lrs[before], p["lrs"]]
    lr_names = [p["lr_name"] for p in pieces if p["lr_name"]]
    lr_name = lr_names[0] if lr_names else None
    pre = HF_PRE_CLIP if name == "train/grad_norm" and "train/epoch" in hits[0][2] else None  # HF's callback's
    source = f"{pieces[0]['run']} (TensorBoard)" if len(pieces) == 1 else f"{path} (TensorBoard, resumed run)"
    marks = [lightning_marks(names, run if run.is_dir() else run.parent) for run, _, names, _ in hits]
    lightning = next((m for m in marks if m), None)
    series = make_series(
        source, name, steps, norms, lrs if lr_name else None, pre_clip=pre, lr_name=lr_name, lightning=lightning
    )
    series.notes += [note for run, *_ in hits for note in torn[run]]
    if len(pieces) > 1:
        spans = ", ".join(f"{p['run'].name}: steps {p['steps'].min()}–{p['steps'].max()}" for p in pieces)
        series.notes.insert(
            0,
            f"{len(pieces)} runs log {name} as pieces of one resumed run ({spans}): merged by step, each later "
            f"piece's values replacing the earlier's from its first step on (pass one run folder to read it alone)",
        )
    return series


def _piece(run: Path, acc, names: list[str], name: str, lr: str | None) -> dict:
    """One run's norm and LR (NaN where it logs none) by step, and the wall time of its first norm event."""
    steps, norms = _event_values(acc, name)
    events = acc.Scalars(name) if name in acc.Tags()["scalars"] else acc.Tensors(name)
    lr_name = pick(names, lr, LR_NAMES, "tag", str(run), "--lr")
    lrs = by_step(*_event_values(acc, lr_name), steps) if lr_name else np.full(len(steps), np.nan)
    order = np.argsort(np.asarray(steps), kind="stable")
    return {
        "run": run,
        "name": name,
        "wall": min(e.wall_time for e in events),
        "steps": np.asarray(steps, dtype=np.int64)[order],
        "norms": np.asarray(norms, dtype=np.float64)[order],
        "lrs": lrs[order],
        "lr_name": lr_name,
    }


def read_csv(path: Path, *, norm: str | None = None, lr: str | None = None, step: str | None = None) -> NormSeries:
    """A step and a norm column; clipamp's own CSV (its canonical eight columns first) also gives the
    skipped steps, the τ in force and the rows the diagnosis reads."""
    try:  # cells as text: a blank cell (a row that logged other metrics) is not a logged "nan"
        df = pd.read_csv(path, sep="\t" if path.suffix == ".tsv" else ",", dtype=str, keep_default_na=False)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not a readable CSV ({one_line(e)})") from None
    cols = [str(c) for c in df.columns]
    name = _need(pick(cols, norm, NORM_NAMES, "column", str(path), "--norm"), cols, "column", str(path), "--norm")
    logged = (df[name].str.strip() != "").to_numpy()  # Lightning's CSVLogger: validation rows leave it blank
    step_name = pick(cols, step, STEP_NAMES, "column", str(path), "--step-column")
    lr_name = pick(cols, lr, LR_NAMES, "column", str(path), "--lr")
    lr_rows = df[df[lr_name].str.strip() != ""] if lr_name and step_name else None  # LearningRateMonitor's own rows
    df = df[logged].reset_index(drop=True)
    values = pd.to_numeric(df[name], errors="coerce")
    steps = np.arange(1, len(df) + 1) if step_name is None else pd.to_numeric(df[step_name], errors="coerce")
    if step_name is not None and steps.isna().any():
        raise UserError(f"{path}: column {step_name!r} has a value that is not a step number: pass --step-column NAME")
    extra: dict = {}
    text, extra["unreadable"] = text_cells(str(path), name, df[name], values, steps)  # tensor(0.69), a stray word
    ours = tuple(cols[:8]) == CANONICAL_COLUMNS
    if ours:
        extra["skipped"] = df["skipped"].astype(str).str.strip().str.lower().isin(["true", "1", "yes"]).to_numpy()
        with open(path, newline="", encoding="utf-8") as f:
            extra["rows"] = [row for row, kept in zip(csv.DictReader(f), logged) if kept]
    for column, key in (("max_norm", "max_norm"), ("token_count", "tokens")):
        if column in cols:
            extra[key] = pd.to_numeric(df[column], errors="coerce").to_numpy()
    lrs = pd.to_numeric(df[lr_name], errors="coerce").to_numpy() if lr_name else None
    if lr_rows is not None:  # the LR of the norm's step, from whichever row logged it
        lr_steps = pd.to_numeric(lr_rows[step_name], errors="coerce")
        lr_values = pd.to_numeric(lr_rows[lr_name], errors="coerce")
        lrs = by_step(lr_steps[lr_steps.notna()], lr_values[lr_steps.notna()], np.asarray(steps))
    pre = "clipamp records grad_l2_pre_clip before clipping" if ours and name == "grad_l2_pre_clip" else None
    extra["lightning"] = lightning_marks(cols, path.parent) if step_name is not None else None
    extra |= csv_run(path, ours)  # the app's config.yaml beside its steps.csv, an integration's steps.clipamp.yaml
    series = make_series(
        f"{path} (CSV)", name, np.asarray(steps), values.to_numpy(), lrs, pre_clip=pre, lr_name=lr_name, **extra
    )
    if step_name is None:
        series.notes.append(f"no step column ({' / '.join(STEP_NAMES)}): row n is step n")
    series.notes += text
    return series


def read_mlflow(run_id: str, *, norm: str | None = None, lr: str | None = None, tracking_uri: str | None = None):
    """The norm metric's history of an MLflow run (``$MLFLOW_TRACKING_URI`` or the default store)."""
    from mlflow.exceptions import MlflowException

    from sweep.tracking.store import sqlite_path
    from sweep.tracking.tracker import open_client, resolve_uri

    uri = resolve_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.exists():  # reading a run never creates a store
        raise UserError(
            f"runs:/{run_id}: no tracking store at {db}: pass --tracking-uri URI of the store that holds it"
        )
    client = open_client(uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise UserError(f"runs:/{run_id}: no such run in {uri}: pass --tracking-uri URI") from None
    keys = sorted(run.data.metrics)
    where = f"runs:/{run_id}"
    if norm is None and run.data.tags.get("sweep_role") == "parent":
        raise UserError(_sweep_parent(client, run, where))
    name = _need(pick(keys, norm, NORM_NAMES, "metric", where, "--norm"), keys, "metric", where, "--norm")
    history = client.get_metric_history(run_id, name)
    steps, norms = [m.step for m in history], [m.value for m in history]
    lr_name = pick(keys, lr, LR_NAMES, "metric", where, "--lr")
    lrs = None
    if lr_name:
        lr_hist = client.get_metric_history(run_id, lr_name)
        lrs = by_step([m.step for m in lr_hist], [m.value for m in lr_hist], steps)
    extra = {}
    tau = _float(run.data.params.get("max_grad_norm"))  # Trainer's MLflowCallback logs its arguments
    if tau and tau > 0:
        extra["max_norm"] = np.full(len(steps), tau)
    if name == "grad_l2_pre_clip" and "grad_l2_post_clip" in keys:  # clipamp's: which steps the run clipped
        post = client.get_metric_history(run_id, "grad_l2_post_clip")
        extra["post"] = by_step([m.step for m in post], [m.value for m in post], steps)
    extra["lightning"] = lightning_marks(keys)  # Lightning's MLFlowLogger logs at global_step too
    extra["settings"], extra["notes"] = own_settings(run.data.params, where)  # the app's, the integrations'
    if extra["settings"]:  # an integration's run: its length as its calibration knew it
        params = run_params(run.data.params, run.data.tags)  # with a resume's change of length
        extra |= run_length(params, extra["notes"], f"{where}: param total_steps None")
    pre = {"grad_norm": HF_PRE_CLIP if "logging_steps" in run.data.params else None}  # Trainer logs its arguments
    pre["grad_l2_pre_clip"] = "clipamp records grad_l2_pre_clip before clipping"
    return make_series(
        f"{where} in {uri} (MLflow)", name, steps, norms, lrs, pre_clip=pre.get(name), lr_name=lr_name, **extra
    )


def _sweep_parent(client, run, where: str) -> str:
    """A sweep's parent run logs no step: its trials (child runs) hold the norms; name the pick's."""
    pick = run.data.metrics.get("pick_trial")
    found = client.search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.study = '{run.data.tags.get('study', '')}' and tags.sweep_role = 'trial' and "
        f"tags.trial = '{int(pick or 0)}'",  # run by any worker of the study
    )
    this = f" runs:/{found[0].info.run_id} (trial {int(pick)}, the pick) or" if pick is not None and found else ""
    return (
        f"{where}: {run.info.run_name} is a sweep's parent run: its trials' runs hold the gradient norms: pass"
        f"{this} another trial's run id ({python_command('sweep.report')} --wide lists them)"
    )


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
