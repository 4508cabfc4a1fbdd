"""A resume's ``steps=`` against the run's length: raised, the run trains further (the LR schedule and the
calibration layout follow the new length); lowered, the run ends sooner, which is accepted only when the steps
it still trains are exactly those the run as started would have trained (its first ``steps`` steps)."""

from __future__ import annotations

from typing import Any

from sweep.config.schema import Config
from sweep.errors import UserError
from sweep.run.build import build_clip_policy, lr_factor
from sweep.run.csv_settings import LENGTH_TAGS, length_tags, resumed_lengths


def check_resume_steps(cfg: Config, ckpt: dict[str, Any], run_id: str) -> None:
    """``UserError`` when ``cfg.steps`` leaves nothing to train after the checkpoint (the run's length named as the
    way on: a length between the two may be refused too), or is below the run's length
    (``ckpt["steps"]``) and the steps after the checkpoint up to ``cfg.steps`` would not train as the run as
    started trains them: another LR (a schedule that decays over ``steps``) or another calibration layout (a
    window placed, cut or repeated by the run's length). Both lengths are named."""
    steps, done, length = cfg.steps, ckpt["step"], ckpt.get("steps")
    was = f" (the run's steps={length})" if length is not None else ""
    if steps <= done:
        further = f"resume with steps={length} or more" if length is not None else "raise steps="
        raise UserError(
            f"resume={run_id}: steps={steps} is not above the checkpoint's step {done}{was}: nothing is left to "
            f"train; {further} to train further, or start a new run with steps={steps} (drop resume=)"
        )
    if length is None or steps >= length:
        return
    new_run = f"start a new run with steps={steps}"
    if short := _window_past(cfg, steps):  # a new run of that length would be refused as it stands
        why, new_run = short, f"{new_run} and a calibrate.window that fits in it"
    else:
        why = _changed_lr(cfg, done, steps, length) or _changed_layout(cfg, ckpt, done, steps, length)
    if why is not None:
        raise UserError(
            f"resume={run_id}: steps={steps} is lower than the run's steps={length}, and {why}: a resume ends a "
            f"run sooner only where its remaining steps train as they would have; resume with steps={length} or "
            f"more, or {new_run} (drop resume=)"
        )


def resumed_length_tags(tags: dict[str, str], ckpt: dict[str, Any], steps: int) -> dict[str, str]:
    """The run's ``LENGTH_TAGS`` after a resume at ``ckpt["step"]`` with ``steps=`` (its MLflow param ``steps`` is
    the first length, and params cannot change), as an integration's resume writes them: ``resumed.total_steps``
    the length now, ``resumed.earlier_lengths`` each earlier length with the last step trained for it. ``{}`` for a
    run whose length never changed; a run resumed back to its first length has them rewritten, not left stale."""
    from ast import literal_eval  # the tag as length_tags writes it

    earlier = literal_eval(tags.get("resumed.earlier_lengths", "[]"))
    afters = [0, *(e["through_step"] for e in earlier)]
    saved = [[a, n] for a, n in zip(afters, [*(e["total_steps"] for e in earlier), ckpt.get("steps", steps)])]
    lengths = resumed_lengths(saved, int(ckpt["step"]), steps)
    return length_tags(lengths) if len(lengths) > 1 or any(k in tags for k in LENGTH_TAGS) else {}


def record_resumed_length(tracker: Any, tags: dict[str, str], ckpt: dict[str, Any], steps: int) -> None:
    """The resumed run's ``resumed_length_tags`` set on it (``tags``: its tags so far), and its earlier lengths
    in ``ckpt["earlier_lengths"]`` (``[]``: none) for the run's result and report."""
    from ast import literal_eval

    tracker.set_tags(new := resumed_length_tags(tags, ckpt, steps))
    ckpt["earlier_lengths"] = literal_eval(new.get("resumed.earlier_lengths", "[]"))


def _window_past(cfg: Config, steps: int) -> str | None:
    """A calibrate run's window that does not close by ``steps`` (the check ``validate`` makes of a new run's
    window, which a resume leaves to this refusal: it cannot change the window)."""
    c = cfg.calibrate
    skip = c.start if isinstance(c.start, int) else 0  # auto starts at step 1 in a run too short to wait
    if cfg.run != "calibrate" or skip + c.window <= steps:
        return None
    return f"calibrate.window={c.window} (from step {skip + 1}) would not close by step {steps}"


def _changed_lr(cfg: Config, done: int, steps: int, length: int) -> str | None:
    """The first remaining step whose LR factor (``lr_factor``) the shorter length changes."""
    for s in range(done, steps):  # the factor of step s + 1
        was, now = lr_factor(s, cfg.optim, length), lr_factor(s, cfg.optim, steps)
        if was != now:
            return (
                f"optim.schedule={cfg.optim.schedule} would change the LR of step {s + 1} "
                f"(x{was:.4g} of optim.lr, now x{now:.4g})"
            )
    return None


def _changed_layout(cfg: Config, ckpt: dict[str, Any], done: int, steps: int, length: int) -> str | None:
    """``clip=calibrated``: where its windows lie over the run's length (``CalibratedClip``, from the checkpoint)."""
    if cfg.clip.mode != "calibrated":
        return None
    state = ckpt["engine"]["clip"]
    was, now = build_clip_policy(cfg, total_steps=length), build_clip_policy(cfg, total_steps=steps)
    was.load_state_dict(state)
    now.load_state_dict(state)
    if was.placement is None and was.detector.latest != now.detector.latest:
        return (
            f"calibrate.start=auto has not placed its window yet and would place it by step "
            f"{now.detector.latest}, not {was.detector.latest}"
        )
    for s in range(done + 1, steps + 1):
        if was.phase(s) != now.phase(s):
            return f"step {s} would be in phase {now.phase(s)}, not {was.phase(s)}"
    return None
