"""Re-running a script that writes ``steps.csv`` works; a refused write leaves the old file byte-identical."""

import hashlib
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

from clipamp_engine.csvlog import StepCSVWriter
from clipamp_engine.records import StepLog


def _log(step, loss=0.5):
    return StepLog(
        step=step, lr=1e-3, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0, loss=loss, scaler_scale=1.0, clipped=True
    )


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(path, steps, **kw):
    with StepCSVWriter(path, **kw) as w:
        for s in steps:
            w.write(_log(s, loss=1.0 / s))


def test_the_default_replaces_an_earlier_steps_csv(tmp_path):
    path = tmp_path / "steps.csv"
    _write(path, (1, 2, 3))
    _write(path, (1, 2))
    assert pd.read_csv(path)["step"].tolist() == [1, 2]


def test_resume_continues_and_a_repeated_step_leaves_the_file_byte_identical(tmp_path):
    path = tmp_path / "steps.csv"
    _write(path, (1, 2, 3))
    with open(path, "a") as f:
        f.write("4,0.001,2.0")  # a row torn by a kill: resuming would drop it, but only on an accepted row
    before = _sha(path)
    with pytest.raises(ValueError, match=r"step 1 is already in .*steps.csv \(last step 3\): the file is unchanged"):
        _write(path, (1,), mode="resume", extra_columns=("clipped", "brand_new_column"))
    assert _sha(path) == before
    _write(path, (4,), mode="resume")
    assert pd.read_csv(path)["step"].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("mode", ["overwrite", "resume", "new"])
def test_a_file_that_is_not_a_steps_csv_is_refused_untouched(tmp_path, mode):
    path = tmp_path / "results.csv"
    path.write_text("epoch,accuracy\n1,0.5\n")
    before = _sha(path)
    with pytest.raises(ValueError, match="results.csv is not a clipamp steps CSV"):
        StepCSVWriter(path, mode=mode)
    assert _sha(path) == before


def test_mode_new_refuses_an_existing_file_untouched(tmp_path):
    path = tmp_path / "steps.csv"
    _write(path, (1, 2))
    before = _sha(path)
    with pytest.raises(ValueError, match="already exists: pass mode='overwrite' to replace it or mode='resume'"):
        StepCSVWriter(path, mode="new")
    assert _sha(path) == before


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(mode="append"), "mode='append' is not one of overwrite, resume, new"),
        (dict(mode="overwrite", truncate_after=2), "truncate_after=2 resumes a file: it needs mode='resume'"),
    ],
)
def test_bad_modes_name_the_choices(tmp_path, kw, msg):
    with pytest.raises(ValueError, match=msg):
        StepCSVWriter(tmp_path / "steps.csv", **kw)


@pytest.mark.slow  # two interpreter runs
def test_rerunning_the_readme_own_loop_snippet_twice_in_one_folder_works(tmp_path):
    script = textwrap.dedent("""
        import torch
        from clipamp_engine.csvlog import StepCSVWriter
        from clipamp_engine.step import AmpTrainState

        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        state = AmpTrainState(model, opt, torch.nn.functional.mse_loss, dtype="bf16", max_norm=1.0)
        with StepCSVWriter("steps.csv") as writer:
            for _ in range(5):
                writer.write(state.step(torch.randn(8, 4), torch.randn(8, 1)))
    """)
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert pd.read_csv(tmp_path / "steps.csv")["step"].tolist() == [1, 2, 3, 4, 5]


def test_a_run_resumed_from_an_older_checkpoint_writes_the_csv_of_a_run_never_stopped(tmp_path):
    """own-loop.md: checkpoint at step 3, killed after step 5, resumed with
    ``truncate_after=state.step_count``: the same bytes as the run that never stopped."""
    import copy

    import torch

    from clipamp_engine.step import AmpTrainState

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        return AmpTrainState(model, opt, torch.nn.functional.mse_loss, dtype="fp32", max_norm=0.5)

    data = [(torch.randn(8, 4, generator=torch.Generator().manual_seed(i)), torch.ones(8, 1)) for i in range(7)]
    state = build()
    with StepCSVWriter(tmp_path / "whole.csv") as w:
        for x, y in data:
            w.write(state.step(x, y))
    state = build()
    with StepCSVWriter(tmp_path / "steps.csv") as w:
        for i, (x, y) in enumerate(data[:5]):
            if i == 3:
                checkpoint = copy.deepcopy(state.state_dict())  # what torch.save keeps
            w.write(state.step(x, y))
    state = build()
    state.load_state_dict(checkpoint)
    with StepCSVWriter(tmp_path / "steps.csv", truncate_after=state.step_count) as w:
        for x, y in data[state.step_count :]:
            w.write(state.step(x, y))
    assert (tmp_path / "steps.csv").read_bytes() == (tmp_path / "whole.csv").read_bytes()
