"""``python -m sweep.recommend``: a clipping threshold from the gradient norms a run already logged.

``readers`` turns a Trainer state, TensorBoard events, a CSV or an MLflow run into a ``NormSeries``
(``series``, with the checks of what it can tell); ``replay`` feeds it to the engine's
``CalibratedClip``; ``report`` prints the runner's calibration report; ``track`` records it in MLflow.
"""

#: Ctrl-C (at start-up or later): one line, exit 130.
STOPPED = "interrupted: the recommendation was not finished"
