"""A resume whose reopen fails after marking the run RUNNING (the store drops, Ctrl-C) puts the run
back as it was, KILLED, so that ``resume=true`` still finds it and nothing reads it as training."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from sweep.tracking.tracker import RunTracker


class DroppingClient(MlflowClient):
    """A client whose metric-history read fails as ``error`` would, once the run is RUNNING."""

    def __init__(self, uri: str, error: BaseException) -> None:
        super().__init__(uri)
        self.error = error

    def get_metric_history(self, run_id, key):
        raise self.error


@pytest.mark.parametrize("error", [ConnectionError("server went away"), KeyboardInterrupt()])
def test_a_failed_reopen_leaves_the_run_killed_with_its_history(store, error):
    client = MlflowClient(store)
    exp = client.create_experiment("e")
    run = RunTracker(client, exp, "r")
    run.add_step(1, {"loss": 2.0})
    run.end("KILLED")
    with pytest.raises(type(error)):
        RunTracker.reopen(DroppingClient(store, error), run.run_id)
    after = client.get_run(run.run_id)
    assert after.info.status == "KILLED"  # before: RUNNING
    assert [m.value for m in client.get_metric_history(run.run_id, "loss")] == [2.0]
    again = RunTracker.reopen(client, run.run_id)  # the resume that follows works
    assert client.get_run(run.run_id).info.status == "RUNNING" and again.logged == {("loss", 1)}
