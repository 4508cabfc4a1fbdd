"""AmpTrainState under DDP and FSDP2 (2 gloo processes on CPU) against one process on the global batch.

Every scenario runs the same global batches twice: sharded over 2 ranks, and whole in one
process (the reference). The batches carry two faults: a NaN input in rank 1's shard at step
3 (a non-finite loss on one rank) and, at step 5, a marker in rank 0's shard that writes an
inf into one element of the last layer's gradient (under FSDP2 that element lives in rank
1's shard only). The reference sees the same faults, so matching it step by step and in the
final parameters proves one global norm, one skip decision and replicas that stay in step.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from clipamp_engine import AmpTrainState, GlobalNormClip, LossScaler, clip_global_l2_norm, has_non_finite_grad

pytestmark = pytest.mark.slow

WORLD = 2
GLOBAL_BATCH = 8
STEPS = 6
NAN_STEP, INF_STEP = 3, 5
LATE_NAN_ROW = 7  # rank 1's second micro-batch under accumulation 2: after its first one's backward
MARK = 7.0  # x[:, 0] == MARK: inf into the gradient of l2.weight[-1, 0]
TIMEOUT = datetime.timedelta(seconds=30)  # a desynchronised collective fails the test, never hangs it


class _InfAt(torch.autograd.Function):
    """Identity on a weight; when ``on``, its gradient gets an inf at ``[-1, 0]`` (one element)."""

    @staticmethod
    def forward(ctx, w, on):
        ctx.on = on
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        if ctx.on:
            g = g.clone()
            g[-1, 0] = float("inf")
        return g, None


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        on = bool((x[:, 0] == MARK).any())
        return F.linear(torch.tanh(self.l1(x)), _InfAt.apply(self.l2.weight, on), self.l2.bias)


def mean_loss(out, target):
    return F.mse_loss(out.float(), target[0])


def token_loss(out, target):
    """(sum over unmasked elements, their count): ranks and micro-batches hold unequal counts."""
    y, mask = target
    return ((out.float() - y) ** 2 * mask).sum(), mask.sum()


def global_batch(step: int, nan_row: int = 5):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    y, mask = torch.randn(GLOBAL_BATCH, 4, generator=g), (torch.rand(GLOBAL_BATCH, 4, generator=g) > 0.4).float()
    if step == NAN_STEP:
        x[nan_row, 2] = float("nan")  # rank 1's shard (rows 4..7); row 7: its second micro-batch under k=2
    if step == INF_STEP:
        x[1, 0] = MARK  # rank 0's shard (rows 0..3)
    return x, (y, mask)


def shard(batch, rank: int, world: int):
    x, (y, mask) = batch
    return x.chunk(world)[rank], (y.chunk(world)[rank], mask.chunk(world)[rank])


class RecordingClip(GlobalNormClip):
    """Clips through the public ``clip_global_l2_norm``; records it, torch's norm and the gathered one."""

    def __init__(self, max_norm):
        super().__init__(max_norm)
        self.torch_norms, self.full_norms, self.public_norms, self.nonfinite = [], [], [], []

    def clip_(self, params, grads, pre, step):
        ref = torch.nn.utils.clip_grad_norm_(params, float("inf"))  # coefficient 1: measures only
        full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
        self.torch_norms.append(float(ref.full_tensor() if hasattr(ref, "full_tensor") else ref))
        self.full_norms.append(float(torch.linalg.vector_norm(torch.cat([f.flatten() for f in full]))))
        self.nonfinite.append(has_non_finite_grad(params))
        public_pre, post = clip_global_l2_norm(params, self.max_norm)
        self.public_norms.append(float(public_pre))
        return post


class NetWithUnused(Net):
    """A layer forward never uses: DDP must be told (``find_unused_parameters=True``)."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(4, 4)


def build(wrap=None, dtype="fp32", k=1, loss_fn=mean_loss, clip=None, net=Net):
    torch.manual_seed(0)
    model = net()
    if wrap is not None:
        model = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    return AmpTrainState(
        model,
        opt,
        loss_fn,
        dtype=dtype,
        accumulation_steps=k,
        clip=clip if clip is not None else GlobalNormClip(1.0),
        scaler=LossScaler("cpu", init_scale=2.0**10, enabled=dtype == "fp16"),
    )


def full_params(model) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def run(state, rank=0, world=1, steps=STEPS, nan_row=5) -> dict:
    rows = [state.step(*shard(global_batch(s, nan_row), rank, world)).row() for s in range(1, steps + 1)]
    return {"rows": rows, "params": full_params(state.model)}


# -- scenarios (run on every rank) ------------------------------------------------------------


def ddp(model):
    return nn.parallel.DistributedDataParallel(model)


def ddp_unused(model):
    return nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)


def fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model)  # one group at the root: l2.weight rows 2..3 live on rank 1


def _counting_ddp(calls):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        calls.append(1)
        return allreduce_hook(None, bucket)

    def wrap(model):
        model = ddp(model)
        model.register_comm_hook(None, hook)
        return model

    return wrap


def scenario_comm(rank, world):
    """Gradient all-reduce calls per optimizer step for accumulation 1 and 4."""
    out = {}
    for k in (1, 4):
        calls = []
        state = build(_counting_ddp(calls), k=k)
        per_step = []
        for s in (1, 2):  # fault-free steps
            before = len(calls)
            state.step(*shard(global_batch(s), rank, world))
            per_step.append(len(calls) - before)
        out[k] = {"calls": per_step, "params": full_params(state.model)}
    return out


def scenario_norms(rank, world):
    clip = RecordingClip(1.0)
    result = run(build(fsdp2, clip=clip), rank, world)
    return {
        **result,
        "torch_norms": clip.torch_norms,
        "full_norms": clip.full_norms,
        "public_norms": clip.public_norms,
        "nonfinite": clip.nonfinite,
    }


def scenario_refusals(rank, world):
    """Several ranks with a model whose gradients nobody reduces, or per-example gradients: refused."""
    from clipamp_engine import make_clip_policy

    messages = []
    for wrap, clip in ((None, None), (ddp, make_clip_policy("dpsgd", noise_multiplier=0.0))):
        try:
            build(wrap, clip=clip)
        except ValueError as e:
            messages.append(str(e))
    torch.manual_seed(0)
    model = ddp(Net())
    fused = AmpTrainState(model, torch.optim.AdamW(model.parameters(), fused=True), mean_loss, dtype="fp32")
    return {"messages": messages, "pipeline": fused.pipeline}


def scenario_fsdp_refusals(rank, world):
    from clipamp_engine import make_clip_policy
    from clipamp_engine.forensics import StepForensics

    messages = []
    for clip, forensics in ((make_clip_policy("update"), False), (None, True), (make_clip_policy("update"), True)):
        torch.manual_seed(0)
        model = fsdp2(Net())
        try:
            AmpTrainState(
                model,
                torch.optim.AdamW(model.parameters()),
                mean_loss,
                clip=clip,
                forensics=StepForensics(model) if forensics else None,
            )
        except ValueError as e:
            messages.append(str(e))
    return {"messages": messages}


def agc_1d(exclude_1d=False):
    """AGC on every parameter, the 1-D biases included (each a single unit: the norm of the whole vector)."""
    from clipamp_engine import make_clip_policy

    return make_clip_policy("agc", clip_factor=0.3, exclude_1d=exclude_1d)


def scenario_ddp_checkpoint(rank, world):
    """A DDP engine's state dict is one process's: a plain module loads its model state, DDP loads it back."""
    state = build(ddp)
    state.step(*shard(global_batch(1), rank, world))
    saved = state.state_dict()
    plain = Net()
    plain.load_state_dict(saved["model"])  # strict: no "module." prefix
    state.load_state_dict(saved)
    return {"keys": sorted(saved["model"]), "params": full_params(plain)}


SCENARIOS = {
    "ddp_checkpoint": scenario_ddp_checkpoint,
    "fsdp_refusals": scenario_fsdp_refusals,
    "refusals": scenario_refusals,
    "ddp_mean": lambda r, w: run(build(ddp), r, w),
    "ddp_token_k2": lambda r, w: run(build(ddp, k=2, loss_fn=token_loss), r, w),
    "ddp_comm": scenario_comm,
    "ddp_mean_k2_late_nan": lambda r, w: run(build(ddp, k=2), r, w, nan_row=LATE_NAN_ROW),
    "ddp_unused_k2": lambda r, w: run(build(ddp_unused, k=2, loss_fn=token_loss, net=NetWithUnused), r, w),
    "fsdp_fp32_norms": scenario_norms,
    "fsdp_token_k2": lambda r, w: run(build(fsdp2, k=2, loss_fn=token_loss), r, w),
    "fsdp_mean_k2_late_nan": lambda r, w: run(build(fsdp2, k=2), r, w, nan_row=LATE_NAN_ROW),
    "fsdp_token_k2_late_nan": lambda r, w: run(build(fsdp2, k=2, loss_fn=token_loss), r, w, nan_row=LATE_NAN_ROW),
    "fsdp_agc_1d": lambda r, w: run(build(fsdp2, clip=agc_1d()), r, w),
    "fsdp_bf16": lambda r, w: run(build(fsdp2, dtype="bf16"), r, w),
    "fsdp_fp16": lambda r, w: run(build(fsdp2, dtype="fp16"), r, w),
}


def _worker(rank, world, init_file, out_dir, names):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT)
    results = {}
    try:
        for name in names:
            try:
                results[name] = SCENARIOS[name](rank, world)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
                break  # the other rank may be stuck in a collective: stop here
    finally:
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        if not any("error" in r for r in results.values()):
            try:  # leave together, as PyTorch's own distributed tests do: a rank that exits first
                dist.barrier()  # can abort its process group ("terminate called without an active exception")
            except Exception:
                pass  # the peer failed and left: nothing to wait for
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown, where a gloo rank can still abort (see sweep.distributed.rank_exit)


def _spawn(tmp_path, names) -> list[dict]:
    torch.multiprocessing.spawn(_worker, args=(WORLD, str(tmp_path / "pg"), str(tmp_path), names), nprocs=WORLD)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return _spawn(
        tmp_path_factory.mktemp("ddp"),
        ["refusals", "ddp_checkpoint", "ddp_mean", "ddp_token_k2", "ddp_comm", "ddp_unused_k2", "ddp_mean_k2_late_nan"],
    )


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return _spawn(
        tmp_path_factory.mktemp("fsdp"),
        [
            "fsdp_refusals",
            "fsdp_fp32_norms",
            "fsdp_token_k2",
            "fsdp_mean_k2_late_nan",
            "fsdp_token_k2_late_nan",
            "fsdp_agc_1d",
            "fsdp_bf16",
            "fsdp_fp16",
        ],
    )


def _get(results, name) -> list[dict]:
    out = [r.get(name, {"error": "not run (an earlier scenario failed)"}) for r in results]
    for rank, r in enumerate(out):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return out


def _assert_same_on_every_rank(per_rank):
    first = per_rank[0]["rows"]
    for other in per_rank[1:]:
        assert [r.keys() for r in other["rows"]] == [r.keys() for r in first]
        for a, b in zip(first, other["rows"]):
            assert a == b or all(
                x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))
                for x, y in zip(a.values(), b.values())
            ), (a, b)
        for p, q in zip(per_rank[0]["params"], other["params"]):
            assert torch.equal(p, q)


def _assert_matches_reference(rows, ref_rows, params, ref_params, rtol=1e-5, atol=1e-6):
    assert [r["skip_reason"] for r in rows] == [r["skip_reason"] for r in ref_rows]
    assert rows[NAN_STEP - 1]["skip_reason"] == "nonfinite_loss"
    assert rows[INF_STEP - 1]["skip_reason"] == "nonfinite_grad"
    taken = [i for i, r in enumerate(ref_rows) if not r["skipped"]]
    for key in ("grad_l2_pre_clip", "grad_l2_post_clip", "loss"):
        got = torch.tensor([rows[i][key] for i in taken], dtype=torch.float64)
        want = torch.tensor([ref_rows[i][key] for i in taken], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=key)
    assert [rows[i]["token_count"] for i in taken] == [ref_rows[i]["token_count"] for i in taken]
    assert [r["scaler_scale"] for r in rows] == [r["scaler_scale"] for r in ref_rows]
    assert any(rows[i]["clipped"] for i in taken) and not all(rows[i]["clipped"] for i in taken)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


# -- DDP ----------------------------------------------------------------------------------------


def test_ddp_matches_one_process_with_global_skips(ddp_results):
    per_rank = _get(ddp_results, "ddp_mean")
    _assert_same_on_every_rank(per_rank)
    ref = run(build())
    _assert_matches_reference(per_rank[0]["rows"], ref["rows"], per_rank[0]["params"], ref["params"])


def test_ddp_with_unused_parameters_skips_globally_without_a_hang(ddp_results):
    """``find_unused_parameters=True``, a layer forward never uses, accumulation 2: the skipped steps
    forward micro-batches with no backward, and the next step's reduction still completes."""
    per_rank = _get(ddp_results, "ddp_unused_k2")
    _assert_same_on_every_rank(per_rank)
    ref = run(build(k=2, loss_fn=token_loss, net=NetWithUnused))
    _assert_matches_reference(per_rank[0]["rows"], ref["rows"], per_rank[0]["params"], ref["params"])
    *_, unused_w, unused_b = per_rank[0]["params"]
    torch.manual_seed(0)
    untouched = NetWithUnused().unused
    assert torch.equal(unused_w, untouched.weight) and torch.equal(unused_b, untouched.bias)


def test_ddp_token_mean_over_unequal_shards_with_accumulation(ddp_results):
    per_rank = _get(ddp_results, "ddp_token_k2")
    _assert_same_on_every_rank(per_rank)
    ref = run(build(k=2, loss_fn=token_loss))
    _assert_matches_reference(per_rank[0]["rows"], ref["rows"], per_rank[0]["params"], ref["params"])
    shard_counts = {int(shard(global_batch(1), r, WORLD)[1][1].sum()) for r in range(WORLD)}
    assert len(shard_counts) > 1  # the ranks' token counts differ, so a per-rank mean would be wrong


def test_ddp_accumulation_all_reduces_once_per_optimizer_step(ddp_results):
    per_rank = _get(ddp_results, "ddp_comm")
    for out in per_rank:
        buckets = out[1]["calls"][0]
        assert buckets >= 1
        assert out[1]["calls"] == [buckets, buckets]
        assert out[4]["calls"] == [buckets, buckets]  # not 4 × buckets: no_sync on micro-batches 1..3
    ref = build(k=4)
    for s in (1, 2):
        ref.step(*global_batch(s))
    for p, q in zip(per_rank[0][4]["params"], full_params(ref.model)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_ddp_checkpoint_is_a_one_process_checkpoint(ddp_results):
    per_rank = _get(ddp_results, "ddp_checkpoint")
    assert per_rank[0]["keys"] == sorted(Net().state_dict())
    ref = build()
    ref.step(*global_batch(1))
    for p, q in zip(per_rank[0]["params"], full_params(ref.model)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# -- FSDP2 --------------------------------------------------------------------------------------


def test_fsdp2_norm_is_the_full_gradient_norm(fsdp_results):
    per_rank = _get(fsdp_results, "fsdp_fp32_norms")
    _assert_same_on_every_rank(per_rank)
    rows = per_rank[0]["rows"]
    engine = [r["grad_l2_pre_clip"] for r in rows if not r["skipped"]]
    for out in per_rank:
        torch.testing.assert_close(torch.tensor(out["torch_norms"]), torch.tensor(engine), rtol=1e-6, atol=0)
        torch.testing.assert_close(torch.tensor(out["full_norms"]), torch.tensor(engine), rtol=1e-6, atol=0)
        assert out["public_norms"] == engine and not any(out["nonfinite"])
    ref = run(build())
    _assert_matches_reference(rows, ref["rows"], per_rank[0]["params"], ref["params"])


def test_fsdp2_token_mean_with_accumulation(fsdp_results):
    per_rank = _get(fsdp_results, "fsdp_token_k2")
    _assert_same_on_every_rank(per_rank)
    ref = run(build(k=2, loss_fn=token_loss))
    _assert_matches_reference(per_rank[0]["rows"], ref["rows"], per_rank[0]["params"], ref["params"])


@pytest.mark.parametrize("loss", ["mean", "token"])
def test_fsdp2_nan_after_a_backward_leaves_no_gradient_for_the_next_step(fsdp_results, loss):
    """Rank 1's loss is NaN in its second micro-batch, after the first one's backward: every rank skips,
    and the gradient FSDP2 accumulated unreduced for that step is discarded, not added to the next."""
    per_rank = _get(fsdp_results, f"fsdp_{loss}_k2_late_nan")
    _assert_same_on_every_rank(per_rank)
    ref = run(build(k=2, loss_fn=mean_loss if loss == "mean" else token_loss), nan_row=LATE_NAN_ROW)
    _assert_matches_reference(per_rank[0]["rows"], ref["rows"], per_rank[0]["params"], ref["params"])


def test_fsdp2_agc_on_1d_parameters_matches_one_process(fsdp_results):
    """``exclude_1d=False``: a bias is one unit, so its norm is over the whole vector, which FSDP2 shards;
    every unit norm is reduced over the mesh and the clipped gradients match one process."""
    per_rank = _get(fsdp_results, "fsdp_agc_1d")
    _assert_same_on_every_rank(per_rank)
    rows, ref = per_rank[0]["rows"], run(build(clip=agc_1d()))
    assert [r["skip_reason"] for r in rows] == [r["skip_reason"] for r in ref["rows"]]
    taken = [i for i, r in enumerate(rows) if not r["skipped"]]
    assert taken and all(rows[i]["clipped"] for i in taken)
    for key in ("grad_l2_pre_clip", "grad_l2_post_clip", "loss"):
        got = torch.tensor([rows[i][key] for i in taken], dtype=torch.float64)
        want = torch.tensor([ref["rows"][i][key] for i in taken], dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=key)
    for p, q in zip(per_rank[0]["params"], ref["params"]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    without_1d = run(build(clip=agc_1d(exclude_1d=True)))["params"]
    assert not torch.allclose(ref["params"][1], without_1d[1], rtol=1e-5, atol=1e-6)  # the biases were clipped


def test_ddp_nan_after_a_backward_leaves_no_gradient_for_the_next_step(ddp_results):
    """The same under DDP: ``no_sync`` accumulates in ``.grad``, which the skip's ``zero_grad`` clears."""
    per_rank = _get(ddp_results, "ddp_mean_k2_late_nan")
    _assert_same_on_every_rank(per_rank)
    ref = run(build(k=2), nan_row=LATE_NAN_ROW)
    _assert_matches_reference(per_rank[0]["rows"], ref["rows"], per_rank[0]["params"], ref["params"])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fsdp2_low_precision_steps_agree_across_ranks(fsdp_results, dtype):
    per_rank = _get(fsdp_results, f"fsdp_{dtype}")
    _assert_same_on_every_rank(per_rank)
    ref = run(build(dtype=dtype))
    # autocast rounds differently on a half batch: compare loosely, skips and scales exactly
    _assert_matches_reference(
        per_rank[0]["rows"], ref["rows"], per_rank[0]["params"], ref["params"], rtol=2e-2, atol=2e-3
    )
    if dtype == "fp16":  # both ranks backed off on the shard-local inf, and on the refused loss
        assert [r["scaler_scale"] for r in per_rank[0]["rows"]][NAN_STEP] < 2.0**10


def test_unreduced_gradients_under_several_ranks_are_refused(ddp_results):
    out = _get(ddp_results, "refusals")[0]
    plain, dpsgd = out["messages"]
    assert out["pipeline"] == "default"  # the fused path cannot agree on skips across ranks
    assert "2 ranks" in plain and "plain Net" in plain and "fully_shard" in plain
    assert "'dpsgd'" in dpsgd and "one process" in dpsgd


def test_fsdp2_refuses_what_needs_whole_parameters(fsdp_results):
    update, forensics, both = _get(fsdp_results, "fsdp_refusals")[0]["messages"]
    assert update == (
        "clip mode 'update' needs whole (unsharded) parameters, which FSDP2 does not keep: use DDP, "
        "or a clip mode other than per_group, update"
    )
    assert forensics == (
        "forensics needs whole (unsharded) parameters, which FSDP2 does not keep: use DDP, "
        "or turn forensics off (forensics=None)"
    )
    assert both == update + "; forensics needs them too: pass forensics=None"
