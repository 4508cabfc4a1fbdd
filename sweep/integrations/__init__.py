"""Adapters for other people's training loops (each imports its framework; nothing imports them).

- ``sweep.integrations.hf_trainer.ClipampCallback``: a ``transformers.TrainerCallback``;
- ``sweep.integrations.lightning.ClipampCallback``: a Lightning ``Callback``;
- ``sweep.integrations.accelerate.ClipampAccelerate``: the clip call of an ``accelerate`` loop;
- ``sweep.integrations.recorder.StepRecorder``: the core they share (measure, clip, record, calibrate);
- ``sweep.integrations.resume``: the recorder's state in a host's checkpoint, and how a resume continues.
"""
