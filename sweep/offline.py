"""The app never reaches the network on its own: every entry point (``python -m sweep``, ``clipamp``,
``python -m sweep.report``, ``python -m sweep.resend``, a torchrun trial's job) sets these switches
before MLflow, ``transformers`` or ``datasets`` is imported.

- ``MLFLOW_DISABLE_TELEMETRY`` / ``DO_NOT_TRACK``: MLflow (>= 3.2) sends usage telemetry to its own
  host unless switched off, and switches itself off only under CI or pytest.
- ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``, ``HF_DATASETS_OFFLINE``, ``HF_HUB_DISABLE_TELEMETRY``:
  ``from_pretrained(<hub name>)`` anywhere (``model=hf``, a ``model=custom`` class) reads the local
  cache only, instead of retrying the hub for half a minute.

A switch the user set already (``HF_HUB_OFFLINE=0`` to let a ``model=custom`` download) is kept.
Tracking and study stores are contacted only at the URL the user gives.
"""

from __future__ import annotations

import os

SWITCHES = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def stay_offline(environ=os.environ) -> None:
    """Set each of ``SWITCHES`` the environment does not set already."""
    for key, value in SWITCHES.items():
        environ.setdefault(key, value)
