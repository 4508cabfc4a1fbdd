"""A ``model=custom`` class whose constructor signals it started (``$CLIPAMP_TEST_MARKER``), then
takes a minute: a Ctrl-C then lands before any run exists."""

import os
import time
from pathlib import Path

import torch


class SlowInit(torch.nn.Module):
    def __init__(self, **_):
        super().__init__()
        Path(os.environ["CLIPAMP_TEST_MARKER"]).touch()
        time.sleep(60)
