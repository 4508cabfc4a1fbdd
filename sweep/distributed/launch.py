"""Training under ``torchrun``: the process group, which rank records, each rank's share of a batch.

``torchrun --nproc_per_node=N -m sweep +experiment=calibrate|train`` starts N ranks. They build
the same task from the same seed, so they draw the same global batches; each trains on its own
contiguous share of every global batch through DDP or FSDP2, and the engine makes the norm, the
skip decisions and the record global (``clipamp_engine.distributed``). Rank 0 alone opens the
tracking store and writes ``steps.csv``, the MLflow run and the report. Host-side agreement
(run ids, stop requests, errors) goes over a gloo group, so it never syncs an accelerator.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from sweep.distributed.rank_failure import RankFailed, diagnose, register
from sweep.errors import UserError

#: Experiments that can run on several ranks.
DISTRIBUTED_RUNS = ("calibrate", "train", "spike")

T = TypeVar("T")


def torchrun_world() -> int | None:
    """The world size when launched by torchrun (it sets ``TORCHELASTIC_RUN_ID``), else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclasses.dataclass
class Launch:
    """This process's place in the job. ``Launch()`` is one process: every method is local."""

    strategy: str = "none"
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: Any = None  # the gloo group for host-side agreement (None: the default group)
    store: Any = None  # torchrun's key-value store (clipamp/ keys): failure records outlive the group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.strategy != "none"

    def agree(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only and return its result (or raise its ``UserError``) on every rank."""
        if not self.distributed:
            return fn()
        outcome: list[Any] = [None]
        if self.is_main:
            try:
                outcome[0] = ("ok", fn())
            except UserError as e:
                outcome[0] = ("error", str(e))
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        kind, value = outcome[0]
        if kind == "error":
            raise UserError(value)
        return value

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on some rank (the same answer on every rank)."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())  # sync: a CPU tensor over gloo, no accelerator involved

    def gather(self, value: T) -> list[T]:
        """``value`` of every rank, in rank order, on every rank."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def refuse_different(self, params: dict[str, Any]) -> None:
        """A ``UserError`` on every rank when the ranks composed different configs (an override that reads
        ``$RANK``, a config file that differs by host): each rank builds its task from its own config,
        while the run logs rank 0's, so the ranks would train on batches one process never sees."""
        every = self.gather(params)
        keys = sorted({k for p in every for k in p if len({repr(q.get(k)) for q in every}) > 1})
        if keys:
            shown = "; ".join(
                f"{k}: " + ", ".join(f"rank {r} {p.get(k)!r}" for r, p in enumerate(every)) for k in keys[:3]
            )
            raise UserError(
                f"the ranks composed different configs ({shown}{'; ...' if len(keys) > 3 else ''}): every rank "
                "must train with the same values (an override read from $RANK or $LOCAL_RANK differs by rank); "
                "pass the same values to every rank"
            )

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def share(self, batches: Iterator[T]) -> Iterator[T]:
        """This rank's contiguous rows of every global batch (``data_source`` stays the batch's)."""
        if not self.distributed:
            yield from batches
            return
        for b in batches:
            yield self.shard(b)

    def shard(self, batch: T) -> T:
        """This rank's contiguous rows of one global batch (views of it: the same storage)."""
        if not self.distributed:
            return batch
        return dataclasses.replace(
            batch, inputs=batch.inputs.chunk(self.world)[self.rank], targets=batch.targets.chunk(self.world)[self.rank]
        )

    def wrap(self, model: nn.Module, device: str) -> nn.Module:
        """The model as DDP, or sharded in place with FSDP2 (each block of ``model.blocks``, then the root)."""
        if self.strategy == "ddp":
            return nn.parallel.DistributedDataParallel(model, device_ids=[self.local_rank] if _cuda(device) else None)
        if self.strategy == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in getattr(model, "blocks", ()):
                fully_shard(block)
            return fully_shard(model)
        return model

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()``, then leave the group (together with the other ranks when ``fn`` returned). Under
        torchrun a failure other than a user mistake becomes a ``RankFailed``: this rank's own
        (recorded for rank 0), or another rank's."""
        done = False
        try:
            result = fn()
            done = True
            return result
        except (UserError, RankFailed):
            raise
        except Exception as e:
            if not self.distributed:
                raise
            raise self.diagnose(e) from None
        finally:
            self.close(together=done)

    def diagnose(self, e: BaseException) -> RankFailed:
        """The failure ``e`` means for the job: this rank's own (recorded for rank 0) or another rank's."""
        return diagnose(e, self.store, self.rank, self.world)

    def close(self, together: bool = False) -> None:
        """Leave the process group. ``together``: first wait at a barrier until every rank has finished,
        so that no rank tears its end of the connections down while rank 0 still ends the run, as
        PyTorch's own distributed tests do before ``destroy_process_group`` (pytorch#11391); the
        process then ends without interpreter teardown (``rank_exit``). A rank that failed meanwhile
        breaks the barrier: its own report says so, this one just leaves."""
        if not (self.distributed and dist.is_initialized()):
            return
        if together:
            try:
                dist.barrier(group=self.group)
            except Exception:  # another rank failed; it reports itself
                pass
        dist.destroy_process_group()


def _cuda(device: str) -> bool:
    return device.split(":")[0] == "cuda"


def resolve_strategy(
    strategy: str, run: str, batch_size: int, clip_mode: str = "norm", forensics: Sequence[str] = ()
) -> tuple[str, int]:
    """``(strategy, world)`` for this launch; a ``UserError`` names an impossible combination (before any
    store is opened), the clip modes and the forensics (``forensics``: the overrides that turn it on,
    ``forensics_on``) the engine refuses under DDP or FSDP2 included.

    ``auto`` is ``ddp`` under torchrun with several processes, else ``none``.
    """
    world = torchrun_world()
    if world is None:
        if strategy in ("ddp", "fsdp2"):
            raise UserError(
                f"dist.strategy={strategy} needs several processes: launch with "
                f"`torchrun --nproc_per_node=N -m sweep …`, or use dist.strategy=none"
            )
        return "none", 1
    if strategy == "auto":
        strategy = "ddp" if world > 1 else "none"
    if strategy == "none":
        if world > 1:
            raise UserError(
                f"torchrun started {world} processes but dist.strategy=none would run {world} "
                "identical jobs: use dist.strategy=ddp or fsdp2, or launch without torchrun"
            )
        return "none", 1
    if run not in DISTRIBUTED_RUNS:
        raise UserError(
            f"+experiment={run} runs in one process: launch it without torchrun "
            f"(under torchrun: +experiment={', '.join(DISTRIBUTED_RUNS[:-1])} or {DISTRIBUTED_RUNS[-1]})"
        )
    if run == "spike" and strategy != "ddp":
        raise UserError(
            f"+experiment=spike under torchrun runs with dist.strategy=ddp, not {strategy}: the "
            "corrupted batch's gradient is measured on the whole (unsharded) model"
        )
    if batch_size % world:
        raise UserError(f"data.batch_size={batch_size} does not split over {world} ranks: use a multiple of {world}")
    from clipamp_engine.clip.registry import whole_param_modes

    if clip_mode == "dpsgd":
        raise UserError(
            f"clip=dpsgd computes per-example gradients outside backward, which {strategy} never reduces: "
            "run it in one process (without torchrun)"
        )
    if strategy == "fsdp2" and clip_mode in whole_param_modes():
        raise UserError(
            f"clip={clip_mode} needs whole (unsharded) parameters, which FSDP2 does not keep: use dist.strategy=ddp, "
            f"or a clip mode other than {', '.join(whole_param_modes())}"
        )
    if refusal := forensics_refusal(strategy, forensics):
        raise UserError(refusal)
    return strategy, world


def forensics_refusal(strategy: str, forensics: Sequence[str]) -> str | None:
    """Why ``dist.strategy=strategy`` cannot run the forensics that the overrides ``forensics`` turn on
    (``forensics_on``), or ``None``: FSDP2 shards the parameters forensics reads whole."""
    if strategy != "fsdp2" or not forensics:
        return None
    keys = [setting.partition("=")[0] for setting in forensics]
    off = " ".join(f"{key}={0 if key == 'forensics.top_k' else 'false'}" for key in keys)
    return (
        f"forensics ({' '.join(forensics)}) needs whole (unsharded) parameters, which FSDP2 does not keep: "
        f"turn it off ({off}) or use dist.strategy=ddp"
    )


def start(
    strategy: str,
    run: str,
    batch_size: int,
    device: str,
    timeout_s: float,
    clip_mode: str = "norm",
    forensics: Sequence[str] = (),
) -> Launch:
    """Join torchrun's process group as ``strategy`` needs (gloo on CPU, nccl on CUDA); ``clip_mode`` and
    ``forensics`` (the overrides that turn it on) are checked against it first (``resolve_strategy``).

    Ranks other than 0 stay silent: their warnings are the same as rank 0's.
    """
    strategy, _ = resolve_strategy(strategy, run, batch_size, clip_mode, forensics)
    if strategy == "none":
        return Launch()
    local_rank = int(os.environ["LOCAL_RANK"])
    if _cuda(device):
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))  # what init_process_group does, kept
    store.set_timeout(timeout)
    dist.init_process_group(
        "nccl" if _cuda(device) else "gloo",
        store=dist.PrefixStore("default_pg", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    group = dist.new_group(backend="gloo") if _cuda(device) else None
    launch = Launch(strategy, rank, world, local_rank, group, dist.PrefixStore("clipamp", store))
    register(launch.store, rank)
    if not launch.is_main:
        warnings.simplefilter("ignore")
    return launch


def rank_from_env() -> int:
    """This process's rank as torchrun set it (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0")) if torchrun_world() is not None else 0
