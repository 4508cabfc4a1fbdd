"""``python -m sweep +experiment=NAME [overrides]``: the clipamp app (Hydra composes ``conf/``).

User mistakes (bad override, unknown choice, wrong type, bad value, missing file, unreachable
store) print one line and exit 2; Ctrl-C / SIGTERM end the run as KILLED and exit 130.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

from sweep.startup import defer_gc, startup_sigint

if __name__ == "__main__":
    startup_sigint(True)  # first: the imports below take seconds
    defer_gc()

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from sweep.commands import python_command
from sweep.config.amp_keys import refuse_scaler_keys
from sweep.config.convert import refuse_renamed, to_config
from sweep.config.keys import given, unknown_key
from sweep.config.schema import RUNS, register
from sweep.config.study_keys import refuse_other_mode_keys, refuse_other_range_keys
from sweep.config.validate import refuse_clip_overrides, refuse_pruning_overrides
from sweep.errors import UserError, fail, one_line, one_line_warnings
from sweep.offline import stay_offline
from sweep.paths import space_refusal, write_refusal
from sweep.run.loop import RunInterrupted
from sweep.secrets import hide_argv, redact_text


def _conf_dir() -> Path:
    """Hydra's config tree: ``conf/`` at a checkout's top level, which the wheel ships as ``sweep/conf``."""
    package = Path(__file__).resolve().parent
    shipped = package / "conf"
    return shipped if shipped.is_dir() else package.parent / "conf"


CONF_DIR = _conf_dir()
register()


def hydra_subdir(output_dir: str, cwd: str) -> str | None:
    """``hydra.output_subdir``: Hydra's files (.hydra/) go to the job's folder only when it is not the
    folder the command ran in (``hydra.run.dir=X``, ``-m``): a plain run leaves no files behind."""
    return None if Path(output_dir).absolute() == Path(cwd).absolute() else ".hydra"


OmegaConf.register_new_resolver("clipamp.hydra_subdir", hydra_subdir, replace=True)


def _user_line(e: BaseException) -> str:
    """The message (and its cause's) on one line, without Hydra's search-path dump."""
    text = str(e)
    if e.__cause__ is not None and str(e.__cause__) not in text:
        text += f": {str(e.__cause__).splitlines()[0]}"
    return redact_text(" ".join(text.split()).split(" Config search path:")[0])


MULTIRUN = ("-m", "--multirun")
#: Hydra's commands, one per command line (its own check is a traceback): each flag's spellings.
COMMANDS = {
    "--run": ("--run", "-r"),
    "-m": MULTIRUN,
    "--cfg": ("--cfg", "-c"),
    "--info": ("--info", "-i"),
    "--shell-completion": ("--shell-completion", "-sc"),
}
#: Flags that only change what ``--cfg`` prints (with the flags that take a value): the overrides still compose.
PRINT_FLAGS, VALUED = ("--cfg", "-c", "--resolve", "--package", "-p"), ("--cfg", "-c", "--package", "-p")


def _split_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` as (its flags, by name, without their values; the overrides)."""
    flags, overrides, value_next = [], [], False
    for arg in argv:
        if value_next:
            value_next = False
        elif arg.startswith("-"):
            flags.append(arg.split("=", 1)[0])
            value_next = arg in VALUED
        else:
            overrides.append(arg)
    return flags, overrides


def _refuse_two_commands(flags: list[str]) -> None:
    """One line, exit 2, for two of Hydra's commands on one command line (``-m --cfg job``)."""
    if any(f in ("--help", "-h", "--hydra-help", "--version") for f in flags):
        return  # Hydra prints those first, whatever else is given
    given = [name for name, spellings in COMMANDS.items() if any(f in spellings for f in flags)]
    if len(given) < 2:
        return
    hint = (
        ": drop -m and give each key one value to print that job's config"
        if given[:2] == ["-m", "--cfg"]
        else ": pass one of them"
    )
    fail(
        f"{given[0]} and {given[1]} cannot be combined: a command runs one of --run, -m, --cfg, --info and "
        f"--shell-completion{hint}"
    )


def precheck(argv: list[str]) -> None:
    """Compose with the user's overrides so composition errors become one line, exit 2 (under ``-m``:
    each value of each sweep; under ``--cfg``, before printing); refuse two of Hydra's commands at once and
    an output folder Hydra could not create (each would end in a traceback)."""
    flags, overrides = _split_flags(argv)
    _refuse_two_commands(flags)
    for arg in overrides:
        key, _, value = arg.lstrip("+").partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir") and value:
            _refuse_unwritable(key, Path(value))
    multirun = any(f in MULTIRUN for f in flags)
    if multirun and not any(a.lstrip("+").startswith("hydra.sweep.dir=") for a in overrides):
        _refuse_unwritable("hydra.sweep.dir", Path("multirun"))  # -m: Hydra's default multirun/DATE/TIME
    if any(f not in MULTIRUN + PRINT_FLAGS for f in flags):  # --help, --info …: leave them to Hydra
        return
    overrides = [a for a in overrides if not a.lstrip("+~").startswith("hydra")]
    from hydra import compose, initialize_config_dir

    try:
        refuse_renamed(overrides)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            for job in _jobs(overrides) if multirun else [overrides]:
                refuse_renamed(job)
                cfg = to_config(compose(config_name="config", overrides=job))
                refuse_clip_overrides(cfg.run, job)
                refuse_pruning_overrides(cfg.run, cfg.study.mode, job)
                refuse_other_mode_keys(cfg.run, cfg.study.mode, job)
                refuse_other_range_keys(cfg.run, cfg.study.mode, cfg.study.anchor, job)
                refuse_scaler_keys(cfg.run, cfg.amp.dtype, job, overrides)
    except Exception as e:  # Hydra/OmegaConf composition and schema errors
        fail(
            _user_line(_unknown_override(e) or _not_a_list(e, overrides) or _two_groups(e) or _no_table(overrides) or e)
        )


def _jobs(overrides: list[str]) -> list[list[str]]:
    """A multirun's overrides to compose: every sweep at its first value, then each other value of each sweep
    in turn (a misspelt key or a bad value of any job, as one line before the first job runs; a
    ``range(…)`` sweep, numbers of one type, by its first and last). ``[]`` when Hydra alone can expand
    them (``glob(…)`` needs its config loader; a syntax error is its own to report)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import RangeSweep

    def values(o) -> list[str]:
        if not o.is_sweep_override():
            return [o.input_line]
        found = [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
        return found[:1] + found[-1:] if isinstance(o.value(), RangeSweep) else found

    try:
        each = [values(o) for o in OverridesParser.create().parse_overrides(overrides)]
    except Exception:
        return []
    first = [vs[0] for vs in each]
    return [first] + [first[:i] + [v] + first[i + 1 :] for i, vs in enumerate(each) for v in vs[1:]]


def _refuse_unwritable(key: str, folder: Path) -> None:
    """One line, exit 2, when Hydra could not create ``folder`` (under a file, a read-only folder, a full disk)."""
    why = write_refusal(folder)
    if why is not None:
        fail(f"{key}={folder}: {why}, so Hydra cannot create its folder there: pass a writable {key}")
    full = space_refusal(folder)
    if full is not None:
        fail(f"{key}={folder}: {full}, so Hydra cannot write its files there: free space there or pass another {key}")


def _unknown_override(e: Exception) -> Exception | None:
    """Hydra's "Could not override 'clip.maxnorm'. To append to your config use +clip.maxnorm=…" for a key
    the schema lacks: the schema's own line (the closest key and the section's keys) instead, since with
    the ``+`` the key would be refused too; ``experiment=NAME`` is missing its ``+`` (the group is added)."""
    found = re.match(r"Could not override '([\w.]+)'", str(e))
    if found and found.group(1) == "experiment":
        value = re.search(r"\+experiment=(\S+)", str(e))
        name = value.group(1) if value else "NAME"
        return UserError(
            f"experiment={name} needs a +: pass +experiment={name} (an experiment is added to the config, not "
            f"overridden; NAME one of {', '.join(RUNS)})"
        )
    return unknown_key(found.group(1)) if found else None


def _no_table(overrides: list[str]) -> UserError | None:
    """OmegaConf's "'NoneType' object has no attribute 'get'" (or "Unexpected type for root") for entries of
    ``clip.patterns`` under a clip mode that holds no table there (only ``clip=per_group`` starts one): that
    mode's own refusal of the key, as ``clip_options`` words it for any option the mode does not take (a calibrate
    run's: the clip group's, ``refuse_clip_overrides``)."""
    table = [o for o in overrides if o.lstrip("+~").startswith("clip.patterns")]
    if not table:
        return None
    from hydra import compose, initialize_config_dir

    from sweep.config.validate import clip_options

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = to_config(compose(config_name="config", overrides=[o for o in overrides if o not in table]))
        if cfg.clip.patterns is not None:
            return None
        refuse_clip_overrides(cfg.run, overrides)  # a calibrate run's clip=calibrated reads calibrate.* only
        clip_options(dataclasses.replace(cfg, clip=dataclasses.replace(cfg.clip, patterns={"": 1.0})))
    except UserError as e:
        return e
    except Exception:
        return None
    return None


def _two_groups(e: Exception) -> UserError | None:
    """Hydra's "Multiple values for experiment. To override a value use 'override experiment: calibrate'" (a
    defaults-list fix) for ``+experiment=train +experiment=calibrate``: one run takes one option of a group."""
    found = re.match(r"Multiple values for ([\w/]+)\.", str(e))
    if not found:
        return None
    group = found.group(1).replace("/", ".")
    return UserError(
        f"+{group}= is given more than once: a run takes one +{group}=NAME; for one run per NAME pass -m +{group}=A,B"
    )


def _not_a_list(e: Exception, overrides: list[str]) -> UserError | None:
    """OmegaConf's "Error merging override K=V: Invalid value assigned: float is not a ListConfig, list or tuple"
    for a list-valued key given a scalar (or a list holding one where a list belongs): the key's shape and its
    default as a command line writes it, read from the config composed without that override."""
    from hydra import compose, initialize_config_dir

    found = re.fullmatch(r"Error merging override ([\w.]+)=(.*)", str(e))
    if not found or not re.match(r"Invalid value assigned: \w+ is not a ListConfig", str(e.__cause__)):
        return None
    key, value = found.groups()
    others = [o for o, (_, k, _) in zip(overrides, given(overrides)) if k != key]
    others = (_jobs(others) or [others])[0]  # a -m sweep: its first job
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            default = OmegaConf.to_container(OmegaConf.select(compose(config_name="config", overrides=others), key))
    except Exception:  # the others do not compose alone: the shape without the default
        default = None
    nested = " of lists" if isinstance(default, list) and default and isinstance(default[0], list) else ""
    example = f": pass e.g. '{key}={_written(default)}' (its default)" if isinstance(default, list) else ""
    return UserError(f"{key}={value}: {key} is a list{nested}{example}")


def _written(value) -> str:
    """``value`` as a Hydra override writes it: ``[[0.0,2.0],[100.0,1.0]]``, ``[fp16,bf16]``."""
    if isinstance(value, list):
        return "[" + ",".join(_written(v) for v in value) + "]"
    return str(value)


def _interrupted_line(e: KeyboardInterrupt, cfg: DictConfig) -> str:
    """What a signal left behind, in one line: which runs ended how, and the command that continues.
    ``RunInterrupted`` is a signal the run handled (its checkpoint written); a bare ``KeyboardInterrupt``
    came before the loop's handler, or through a sweep's trial."""
    run, handled = cfg.get("run"), isinstance(e, RunInterrupted)
    head = f"interrupted ({e})" if handled else "interrupted"
    if run == "spike" or (run == "sweep" and cfg.study.mode == "entangle"):  # children take no resume=
        what = "the spike replay" if run == "spike" else "the LR check"
        ended = (
            f"{what} ended KILLED (the run it was training finished first)"
            if handled and e.finished
            else f"{what} and the run it was training ended KILLED"
        )
        return f"{head}: {ended}; re-run the same command to start it again"
    if run == "sweep" and getattr(e, "sweep_ended", None):  # every trial ended: only the report was cut
        return (
            f"{head}: every trial this command ran ({e.trials}) finished and its parent run ended {e.sweep_ended}; "
            f"`{python_command('sweep.report')}` gives the study's pick (re-running the command would add new trials)"
        )
    if run == "sweep" and getattr(e, "anchor_window", False):  # before any trial: the study's anchor window
        return (
            f"{head}: the anchor window's run ended KILLED before any trial ran; re-run the same command to "
            "resume the study (it runs the window again)"
        )
    if run == "sweep":  # the parent run has no steps.csv: each trial's run has its own
        head = f"interrupted ({e})" if getattr(e, "at_boundary", False) else head  # its signal's name
        return f"{head}: {_sweep_ended(e, handled)}; re-run the same command to resume the study"
    if handled and e.finished is not None:
        return f"interrupted ({e}) during the end-of-run phase: " + (
            "it completed first; the run ended FINISHED with its summary and artifacts"
            if e.finished
            else "cut short by a second signal; the run ended KILLED: steps.csv holds every step, but summary "
            "metrics and artifacts are incomplete ("
            + (
                "nothing to resume: re-run without resume= for them)"
                if getattr(e, "checkpointed", None) is None
                else f"resume=true continues from its checkpoint at step {e.checkpointed} (the steps after it run "
                "again) and completes them)"
            )
        )
    if handled:
        return (
            f"{head}: checkpoint written, run ended KILLED, steps.csv keeps every completed step; continue with the "
            "same command plus resume=true"
        )
    if getattr(e, "run_ended", None):  # set by the pipeline when it ended a run that had trained
        at = getattr(e, "checkpointed", None)  # its latest checkpoint's step (a second signal writes none)
        return f"{head}: run ended KILLED, steps.csv keeps every completed step; " + (
            f"resume=true continues from its checkpoint at step {at} (the steps after it run again)"
            if at is not None
            else "it wrote no checkpoint (checkpoint_every), so nothing to resume: re-run the same command"
        )
    return f"{head}: before the first step: no step ran, nothing to resume; re-run the same command"


def _sweep_ended(e: KeyboardInterrupt, handled: bool) -> str:
    """Which runs of a sweep a signal ended: the trial's that was training (a steps.csv), and the parent's."""
    if getattr(e, "at_boundary", False):  # a phase boundary of the sweep (``honour``): no trial was training
        return "no trial was training: the sweep's parent run ended KILLED"
    if handled and e.finished is False:
        return (
            "the trial's run ended KILLED in its end-of-run phase (cut short by a second signal: its steps.csv "
            "keeps every step, its summary is incomplete), the sweep's parent run too"
        )
    if handled or getattr(e, "run_ended", None):  # set by the pipeline when it ended a run that had trained
        return "the trial ended KILLED (its run's steps.csv keeps every completed step), the sweep's parent run too"
    return "the sweep's parent run ended KILLED"


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")  # a path: no pkg:// lookup
def main(cfg: DictConfig) -> None:
    from sweep.app import run
    from sweep.distributed.launch import rank_from_env, torchrun_world
    from sweep.distributed.rank_failure import RankFailed
    from sweep.tracking.busy import locked_line, store_locked
    from sweep.tracking.tracker import own_run_lines, resolve_uri

    startup_sigint(False)  # from here the app handles Ctrl-C
    own_run_lines()
    one_line_warnings()
    try:
        hydra_cfg = HydraConfig.get()
        run(to_config(cfg), list(hydra_cfg.overrides.task), base_dir=Path(hydra_cfg.runtime.cwd))
    except UserError as e:
        fail(_user_line(e), getattr(e, "status", 2))
    except KeyboardInterrupt as e:  # RunInterrupted (a signal the run handled) or a bare Ctrl-C
        if rank_from_env() != 0:
            sys.exit(130)
        print(_interrupted_line(e, cfg), file=sys.stderr)
        sys.exit(130)
    except RankFailed as e:  # under torchrun: rank 0 reports the failure of whichever rank failed
        line = e.report(rank_from_env())
        if line is not None:
            print(f"error: {redact_text(line)}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:
        if store_locked(e):  # another process held the sqlite store past LOCK_WAIT_S
            fail(redact_text(locked_line(resolve_uri(cfg.tracking.uri), cfg.run)), 1)
        if torchrun_world() is None:
            raise  # one process: a bug keeps its traceback
        # under torchrun before the ranks could agree (joining the process group): each failing rank says so
        print(
            f"error: {redact_text(f'rank {rank_from_env()} of {torchrun_world()} failed: {one_line(e)}')}",
            file=sys.stderr,
        )
        sys.exit(1)


def cli() -> None:
    startup_sigint(True)  # again for a caller that imported this module itself
    stay_offline()  # before MLflow, transformers or datasets is imported
    sys.argv[1:] = hide_argv(sys.argv[1:])  # before Hydra can write or echo a password
    precheck(sys.argv[1:])
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun rank ends without interpreter teardown
        from sweep.distributed.rank_exit import run_then_leave

        run_then_leave(main)
    main()


if __name__ == "__main__":
    cli()
