"""Which config changes a resume accepts: the keys that do not change the maths of the remaining
steps, and a ``dist.strategy`` whose checkpoint is one process's either way."""

from __future__ import annotations

import pytest

from sweep.run.checkpoint import config_differences

LOGGED = {"steps": "500", "dist.strategy": "ddp", "dist.timeout_s": "600.0", "accumulation_steps": "1"}


@pytest.mark.parametrize(
    "change,refused",
    [
        ({"steps": "800"}, []),
        ({"dist.timeout_s": "30.0"}, []),
        ({"dist.strategy": "none"}, []),  # a DDP checkpoint resumed in one process
        ({"dist.strategy": "auto"}, []),
        ({"dist.strategy": "fsdp2"}, ["dist.strategy (run: ddp, now: fsdp2)"]),  # sharded: not the same checkpoint
        ({"accumulation_steps": "2"}, ["accumulation_steps (run: 1, now: 2)"]),
    ],
)
def test_a_resume_accepts_what_keeps_the_maths_and_names_the_rest(change, refused):
    assert config_differences(LOGGED, LOGGED | change) == refused


def test_an_fsdp2_run_resumes_under_fsdp2_only():
    logged = LOGGED | {"dist.strategy": "fsdp2"}
    assert config_differences(logged, logged) == []
    for other in ("auto", "none", "ddp"):
        assert config_differences(logged, logged | {"dist.strategy": other}) == [
            f"dist.strategy (run: fsdp2, now: {other})"
        ]


def test_a_changed_dict_valued_setting_is_refused_as_a_whole():
    """``clip.patterns`` is logged one param per entry: an entry renamed, added or dropped is a change."""
    from sweep.run.artifacts import logged_params
    from tests.app.helpers import compose_cfg

    def params(*overrides):
        return logged_params(compose_cfg("+experiment=train", "clip=per_group", *overrides))

    attn = params("+clip.patterns={attn: 0.5}")
    assert config_differences(attn, attn) == []
    assert config_differences(attn, params("+clip.patterns={mlp: 0.5}")) == [
        "clip.patterns (run: {attn: 0.5}, now: {mlp: 0.5})"
    ]
    assert config_differences(attn, params("+clip.patterns={attn: 0.5, mlp: 1.0}")) == [
        "clip.patterns (run: {attn: 0.5}, now: {attn: 0.5, mlp: 1.0})"
    ]
    assert config_differences(attn, params()) == ["clip.patterns (run: {attn: 0.5}, now: {})"]
    assert config_differences(params("+model.kwargs={d: 8}"), params()) == ["model.kwargs (run: {d: 8}, now: {})"]


def test_the_cuda_generator_travels_with_the_checkpoint(tmp_path, monkeypatch):
    """On a GPU, dropout masks draw from the CUDA generator: a resumed run must continue its stream, not
    restart it from the seed. (CUDA itself is stood in for here; the CPU generator is the real one.)"""
    import torch
    import torch.nn.functional as F

    from clipamp_engine import AmpTrainState
    from sweep.distributed.launch import Launch
    from sweep.run.checkpoint import restore_run_checkpoint, save_checkpoint

    generator = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: generator["state"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: generator.update(state=s.clone()))
    model = torch.nn.Linear(2, 1)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, dtype="fp32")
    path = tmp_path / "checkpoint.pt"
    assert save_checkpoint(path, state, step=0)
    generator["state"] = torch.tensor([9, 9, 9], dtype=torch.uint8)  # the stream moved on (or a new process)
    ckpt = torch.load(path, weights_only=False)
    restore_run_checkpoint(path, state, ckpt, Launch())
    assert generator["state"].tolist() == [1, 2, 3]
    del ckpt["cuda_rng"]  # a checkpoint written before the CUDA state was kept still restores
    restore_run_checkpoint(path, state, ckpt, Launch())


@pytest.mark.parametrize("error", [KeyboardInterrupt("second signal 2"), RuntimeError("writer failed")])
def test_a_checkpoint_write_cut_short_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch, error):
    """A second Ctrl-C (or a failure) inside ``torch.save``: the previous checkpoint is intact and no
    ``checkpoint.pt.tmp`` is left beside it."""
    import torch
    import torch.nn.functional as F

    from clipamp_engine import AmpTrainState
    from sweep.run import checkpoint as C

    model = torch.nn.Linear(2, 1)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, dtype="fp32")
    path = tmp_path / "checkpoint.pt"
    assert C.save_checkpoint(path, state, step=1)
    before = path.read_bytes()
    real = torch.save

    def cut_short(obj, f):
        real(obj, f)  # the bytes are on disk, not yet renamed
        raise error

    monkeypatch.setattr(C.torch, "save", cut_short)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(type(error)):
        C.save_checkpoint(path, state, step=2)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # before: checkpoint.pt.tmp too


def test_resume_true_under_another_name_and_a_short_id_say_what_to_pass(tmp_path, store):
    """A changed amp.dtype or model changes the run's name, so ``resume=true`` finds nothing by that name: the
    line names the latest run with a checkpoint and its whole id; an id cut short says an id is 32 hex digits."""
    from mlflow import MlflowClient

    from sweep.errors import UserError
    from sweep.run.checkpoint import checkpoint_path, find_resumable

    uri = store  # the default store, migrated already
    client = MlflowClient(uri)
    exp = client.create_experiment("clipamp")
    killed = client.create_run(exp, run_name="train-gpt-bf16").info.run_id
    client.create_run(exp, run_name="calibrate-gpt-bf16")  # newer, without a checkpoint
    ckpt = checkpoint_path(uri, killed)
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"")
    assert find_resumable(client, exp, "train-gpt-bf16", uri, "true") == killed
    with pytest.raises(UserError) as e:
        find_resumable(client, exp, "train-gpt-fp32", uri, "true")
    assert str(e.value) == (
        "resume=true: no run named 'train-gpt-fp32' with a checkpoint in experiment 'clipamp'; start a new run "
        "(drop resume=) or pass resume=RUN_ID; the latest run with one is 'train-gpt-bf16': a run's name says its "
        "experiment, model and dtype, so another amp.dtype or model looks for another name; "
        f"resume={killed} continues that run and names any setting that differs"
    )
    short = rf"resume='{killed[:8]}' is not a run id in this tracking store \(a run id is 32"
    with pytest.raises(UserError, match=short):
        find_resumable(client, exp, "train-gpt-bf16", uri, killed[:8])


def test_a_string_that_is_no_run_id_suggests_only_a_resume_that_continues_a_run(tmp_path, store):
    """``resume=0123abcd`` suggests ``resume=true`` only where a run of that name has a checkpoint; else the
    whole id of the latest run that has one, or, with none, a new run. Each suggestion, passed back, resolves."""
    import re

    from mlflow import MlflowClient

    from sweep.errors import UserError
    from sweep.run.checkpoint import checkpoint_path, find_resumable

    client = MlflowClient(store)
    exp = client.create_experiment("clipamp")

    def refused(name: str) -> str:
        with pytest.raises(UserError) as e:
            find_resumable(client, exp, name, store, "0123abcd")
        return str(e.value)

    lead = "resume='0123abcd' is not a run id in this tracking store (a run id is 32 hex digits: "
    client.create_run(exp, run_name="train-gpt-bf16")  # no checkpoint
    line = refused("train-gpt-bf16")
    assert line.startswith(lead) and "resume=true" not in line and "resume=RUN_ID" not in line
    assert line.endswith(
        "--wide lists them); no run named 'train-gpt-bf16' with a checkpoint in experiment 'clipamp'; start a new "
        "run (drop resume=)"
    )
    other = client.create_run(exp, run_name="train-gpt-fp32").info.run_id
    checkpoint_path(store, other).parent.mkdir(parents=True)
    checkpoint_path(store, other).write_bytes(b"")
    line = refused("train-gpt-bf16")
    assert "resume=true" not in line
    suggested = re.search(r"resume=([0-9a-f]{32}) continues that run", line).group(1)
    assert find_resumable(client, exp, "train-gpt-bf16", store, suggested) == other
    line = refused("train-gpt-fp32")
    assert (
        line
        == f"{lead}{line[len(lead) :].split(')', 1)[0]}); use resume=true for the latest run named 'train-gpt-fp32'"
    )
    assert find_resumable(client, exp, "train-gpt-fp32", store, "true") == other
