"""A process that exits with a recorder's run still open (an exception out of ``Trainer.train()`` or a
hand loop: ``end()`` never runs) ends its MLflow run as FAILED or KILLED, every recorded step in it,
instead of leaving it RUNNING with the last steps' metrics unsent."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # each test runs a Trainer or a loop in a fresh interpreter until it dies

ROOT = Path(__file__).resolve().parents[3]

HF = """
import sys
from transformers import TrainerCallback
from sweep.integrations.hf_trainer import ClipampCallback
from tests.app.integrations.test_hf_trainer import trainer

class Boom(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:
            raise RuntimeError("data loader died")

cb = ClipampCallback(window=4, tracking=sys.argv[1], verbose=False)
trainer(Path("."), [cb, Boom()], steps=8, max_grad_norm=1.0).train()
"""

LOOP = """
import sys
import torch
from sweep.integrations.recorder import StepRecorder

model = torch.nn.Linear(4, 1)
recorder = StepRecorder(tracking=sys.argv[1], verbose=False, calibrate={"window": 4})
recorder.begin(total_steps=8, user_tau=1.0, default_csv=Path("steps.csv"))
for step in range(1, 9):
    model.zero_grad()
    model(torch.randn(8, 4)).square().mean().backward()
    recorder.record(step, 0.1, recorder.measure(list(model.parameters()), step, host_clips=False))
    if step == 5:
        raise KeyboardInterrupt
"""


SAME_PROCESS_RESUME = """
import sys
from sweep.integrations.accelerate import ClipampAccelerate
from tests.app.integrations.test_accelerate_resume import OPTIONS, STEPS, loop

def make(acc):
    return ClipampAccelerate(acc, total_steps=STEPS, tracking=sys.argv[1], verbose=False, **OPTIONS)

loop(Path("."), make, kill=True)  # a notebook cell that crashed after step 8 (save_state at 6), end() never run
loop(Path("."), make, load=True)  # the next cell resumes in the same process and finishes
"""


def run_script(tmp_path, code: str, store: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text("from pathlib import Path\n" + textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(script), store], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("code", "status", "error"),
    [(HF, "FAILED", "RuntimeError: data loader died"), (LOOP, "KILLED", "KeyboardInterrupt")],
    ids=["trainer-error", "loop-ctrl-c"],
)
def test_a_process_that_dies_mid_run_ends_its_run(tmp_path, store, code, status, error):
    done = run_script(tmp_path, code, store)
    assert done.returncode != 0 and error in done.stderr
    client = MlflowClient(store)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == status
    assert f"clipamp: MLflow run {run.info.run_id} ended as {status} at step 5" in done.stderr
    history = client.get_metric_history(run.info.run_id, "grad_l2_pre_clip")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]  # flushed: none of the 5 steps lost
    csv = Path(client.download_artifacts(run.info.run_id, "steps.csv", str(tmp_path)))
    assert [line.split(",")[0] for line in csv.read_text().splitlines()[1:]] == ["1", "2", "3", "4", "5"]


def test_a_run_resumed_in_the_same_process_is_not_ended_by_the_crashed_ones_exit(tmp_path, store):
    """The crashed loop's recorder lets go of the run the resumed one continues: after the process exits
    the run is FINISHED and holds every step once (not KILLED, not steps 1–8 twice)."""
    done = run_script(tmp_path, SAME_PROCESS_RESUME, store)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(store)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and "ended as" not in done.stderr
    history = client.get_metric_history(run.info.run_id, "grad_l2_pre_clip")
    assert sorted(m.step for m in history) == list(range(1, 13))
