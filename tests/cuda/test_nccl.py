"""DDP over NCCL (2 ranks, one GPU each) against one process on the global batch: the same skips
(an inf gradient on one rank, a NaN loss on the other), records and parameters on every rank."""

import math
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from clipamp_engine.scaling import LossScaler
from clipamp_engine.step import AmpTrainState

from .helpers import CUDA, Net, batch

pytestmark = [
    *CUDA,
    pytest.mark.skipif(
        torch.cuda.device_count() < 2, reason="NCCL across ranks needs 2 CUDA devices (one rank per GPU)"
    ),
]

WORLD, STEPS, INF_STEP, NAN_STEP = 2, 8, 3, 5


def _train(model, device, rank, world):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = LossScaler("cuda", init_scale=2.0**10, growth_interval=3)
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp16", max_norm=0.5, scaler=scaler)
    net = model.module if world > 1 else model
    rows = []
    for i in range(STEPS):
        x, y = batch(i, n=16)
        x, y = x[rank::world].to(device), y[rank::world].to(device)
        if i + 1 == INF_STEP and rank == 0:
            net.poison = float("inf")  # this rank's local gradient, before the all-reduce
        if i + 1 == NAN_STEP and rank == world - 1:
            y = y * float("nan")
        rows.append(state.step(x, y))
    return rows, [p.detach().cpu() for p in model.parameters()]


def _worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=torch.device("cuda", rank))
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(Net().cuda(rank), device_ids=[rank])
        result = _train(model, torch.device("cuda", rank), rank, WORLD)
    except Exception:
        result = traceback.format_exc()
    finally:
        torch.save(result, f"{out}/rank{rank}.pt")
        dist.destroy_process_group()


def test_ddp_nccl_matches_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(port, str(tmp_path)), nprocs=WORLD)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for rank, r in enumerate(results):
        assert not isinstance(r, str), f"rank {rank}:\n{r}"
    torch.manual_seed(0)
    ref_rows, ref_params = _train(Net().cuda(), torch.device("cuda"), 0, 1)
    assert (
        ref_rows[INF_STEP - 1].skip_reason == "nonfinite_grad"
        and ref_rows[NAN_STEP - 1].skip_reason == "nonfinite_loss"
    )
    for rows, params in results:
        assert [r.skip_reason for r in rows] == [r.skip_reason for r in ref_rows]
        assert [r.scaler_scale for r in rows] == [r.scaler_scale for r in ref_rows]
        for a, b in zip(rows, ref_rows):
            if not b.skipped:
                assert a.grad_l2_pre_clip == pytest.approx(b.grad_l2_pre_clip, rel=1e-4)
                assert math.isclose(a.loss, b.loss, rel_tol=1e-4)
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q.cpu(), rtol=1e-4, atol=1e-5)
    for p, q in zip(results[0][1], results[1][1]):
        assert torch.equal(p, q)
