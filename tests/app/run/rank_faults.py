"""A ``model=custom`` for the rank-failure tests: ``TinyMLPLM`` whose training forward fails on one rank.

``CLIPAMP_TEST_RANK_FAULT=HOW:RANK:STEP`` (HOW ``raise`` or ``kill``) makes the STEP-th training forward on
torchrun rank RANK raise a ``RuntimeError`` (a bug in user code) or SIGKILL its own process (as the
OOM killer would). Without the variable (e.g. on resume) the model is plain ``TinyMLPLM``: the fault
is in the environment, not in the run's params, so a resume with the same config is accepted.
"""

from __future__ import annotations

import os
import signal

from sweep.tasks.models import TinyMLPLM


class RankFault(TinyMLPLM):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = -1  # the first training forward is model=custom's training-mode check, before step 1

    def forward(self, idx):
        if self.training:
            self.calls += 1
            how, rank, step = (os.environ.get("CLIPAMP_TEST_RANK_FAULT", "none:-1:0").split(":") + ["", ""])[:3]
            if os.environ.get("RANK") == rank and self.calls == int(step):
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected fault in forward at step {step}")
        return super().forward(idx)
