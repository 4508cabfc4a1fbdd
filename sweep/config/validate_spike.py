"""The checks of ``+experiment=spike``: the replay's timing against the calibration windows, its sizes,
the fp16 pair's overrides and where its figure goes."""

from __future__ import annotations

from pathlib import Path

from sweep.config.schema import FAULTS, Config, window_ranges
from sweep.errors import UserError
from sweep.paths import write_refusal


def check_spike(cfg: Config) -> None:
    """``+experiment=spike``: byte data, positive sizes, the spike after the window and before the end, and a
    ``figure_out`` it can write."""
    s = cfg.spike
    if cfg.resume:
        raise UserError(
            f"resume={cfg.resume}: the spike replay is not resumable (its arms are twin runs from step 1, each "
            "compared with its pair); re-run the command without resume= to start it again"
        )
    if cfg.calibrate.start != 0:
        raise UserError(
            f"calibrate.start={cfg.calibrate.start}: the spike replay times its bad batch after a "
            f"window from step 1; pass calibrate.start=0"
        )
    if cfg.data.name == "synthetic":
        raise UserError(
            "spike needs byte data (the corrupted batch is a binary blob): "
            "pass data=stdlib or data=text, not data=synthetic"
        )
    for key, example in (("factor", "20"), ("fixed_max_norm", "1.0"), ("recovery_tolerance", "0.05 (5%)")):
        if not getattr(s, key) > 0:
            raise UserError(
                f"spike.{key}={getattr(s, key)} must be > 0, e.g. "
                + (f"spike.{key}={example}" if key != "recovery_tolerance" else example)
            )
    if not s.horizons or any(h < 1 for h in s.horizons):
        raise UserError(f"spike.horizons={list(s.horizons)} must be positive step counts, e.g. [1,5,20,100]")
    if s.peak_window < 0:
        raise UserError(f"spike.peak_window={s.peak_window} must be >= 0 (0: the peak since step 1)")
    last = max(s.horizons)
    if not 2 <= s.at_step <= cfg.steps - last:
        raise UserError(
            f"spike.at_step={s.at_step} must be in [2, steps - {last}] with steps={cfg.steps} "
            f"(the last horizon is +{last}): raise steps to >= {s.at_step + last} or lower spike.at_step"
        )
    _check_spike_windows(cfg)
    if hit := [name for name in FAULTS if s.at_step in getattr(cfg.faults, name)]:
        raise UserError(
            f"faults.{hit[0]}={list(getattr(cfg.faults, hit[0]))} hits spike.at_step={s.at_step}: the fault would "
            "act on the unspiked twin's measurement of the corrupted batch (a non-finite norm: its loss scaled by "
            "0 or nan, no spike) and on the twin itself; put the fault at another step"
        )
    _check_fp16_overrides(cfg)
    why = write_refusal(Path(s.figure_out), is_file=True) if s.figure_out else None
    if why is not None:  # found now, not after the whole replay
        raise UserError(f"spike.figure_out={s.figure_out}: {why}: pass a file path in a writable folder")
    if s.figure_out and Path(s.figure_out).suffix.lower() != ".png":
        raise UserError(f"spike.figure_out={s.figure_out}: the figure is a PNG; pass a file name ending in .png")


#: The ``model.*`` keys that act on a ``model=hf`` model; the others (d_model, n_layer, ...) size the built-in ones.
HF_MODEL_KEYS = ("config", "pretrained", "freeze", "train_only")
HF_FP16_EXAMPLE = (
    '\'spike.fp16_overrides=["model.config.hidden_size=32","model.config.intermediate_size=64",'
    '"model.config.num_hidden_layers=2","data.seq_len=64","amp.growth_interval=20"]\''
)


def _check_fp16_overrides(cfg: Config) -> None:
    """Under ``model=hf``, refuse fp16 overrides that would silently leave the model at full size
    (the default ones shrink the built-in GPT: ``model.d_model``...; a pretrained model has a fixed size)."""
    if not cfg.spike.fp16:
        return
    keys = [o.split("=", 1)[0].lstrip("+~") for o in cfg.spike.fp16_overrides]
    shared = [k for k in keys if k == "steps" or k.startswith("spike.")]
    if shared:  # the table and figure read every arm at the same steps (the fp16 pair's too)
        raise UserError(
            f"spike.fp16_overrides sets {', '.join(shared)}, which the fp16 pair shares with the other runs "
            "(one table and figure over the same steps): set it for the whole replay instead, e.g. steps=300"
        )
    if cfg.model.name != "hf":
        return
    models = [k for k in keys if k.startswith("model.")]
    inert = [k for k in models if k.split(".")[1] not in HF_MODEL_KEYS]
    if cfg.model.pretrained:
        inert += [k for k in models if k.startswith("model.config.")]
    if inert:
        fix = (
            "'spike.fp16_overrides=[\"amp.growth_interval=20\"]' (a pretrained model keeps its size)"
            if cfg.model.pretrained
            else f"shrink the model with model.config keys, e.g. {HF_FP16_EXAMPLE}"
        )
        raise UserError(
            f"spike.fp16_overrides sets {', '.join(inert)}, which do nothing for model=hf"
            f"{' model.pretrained=DIR' if cfg.model.pretrained else ''} (the fp16 pair would run the "
            f"full-size model): pass spike.fp16=false, or {fix}"
        )


def _check_spike_windows(cfg: Config) -> None:
    s, windows = cfg.spike, window_ranges(cfg)
    if not windows or windows[0][-1] >= s.at_step:
        w = windows[0] if windows else range(1, 1)
        raise UserError(
            f"spike.at_step={s.at_step} must land after the calibration window ends "
            f"(calibrate.window={cfg.calibrate.window} ends at step {w[-1] if w else '?'}): "
            f"raise spike.at_step or lower calibrate.window"
        )
    late = [w for w in windows if w[-1] >= s.at_step]
    if late:
        raise UserError(
            f"calibrate.every={cfg.calibrate.every} opens a calibration window at steps "
            f"{late[0][0]}–{late[0][-1]}, at or after spike.at_step={s.at_step}, which would re-calibrate "
            f"τ from the spike and its aftermath while the replay measures them: use calibrate.every=0, or a "
            f"larger calibrate.every that opens no window in steps {s.at_step}–{cfg.steps}"
        )
