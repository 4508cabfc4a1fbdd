"""One calibration procedure everywhere: one norm sequence through the runner's policy, the own-loop API,
the HF callback and the Lightning callback gives the same window, τ, interval, verdict and next action (the
action each front end prints names the settings as its user writes them: compared spelled alike)."""

from __future__ import annotations

import math

import pytest
import torch

from clipamp_engine.clip.calibrated import recommended_calibration
from clipamp_engine.spelling import ENGINE
from clipamp_engine.step import AmpTrainState
from sweep.config.schema import calibrated
from sweep.run.build import APP_SPELLING, build_clip_policy
from tests.app.helpers import compose_cfg

STEPS, WARMUP = 500, 20


def lr_at(step0: int) -> float:
    """LR factor after ``step0`` taken steps: linear warm-up, then cosine decay."""
    if step0 < WARMUP:
        return (step0 + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step0 - WARMUP) / (STEPS - WARMUP)))


def norm_sequence() -> torch.Tensor:
    """A transient that decays, then lognormal noise around 1; fp32 values (a 1-element gradient's norm is exact)."""
    g = torch.Generator().manual_seed(4)
    t = torch.arange(1, STEPS + 1, dtype=torch.float64)
    noise = torch.exp(0.25 * torch.randn(STEPS, generator=g, dtype=torch.float64))
    return (4.0 * torch.exp(-t / 12) + noise).float()


class Probe(torch.nn.Module):
    """One weight; ``loss = w · c`` has gradient ``c`` whatever ``w`` is."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, c):
        return (self.w * c).sum()


def _opt_sched(model):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at)


def through_the_engine(policy):
    model = Probe()
    opt, sched = _opt_sched(model)
    state = AmpTrainState(model, opt, lambda loss, _: loss, dtype="fp32", clip=policy, scheduler=sched)
    for c in norm_sequence():
        state.step(c.reshape(1), torch.zeros(1))
    return policy


def through_the_hf_callback():
    pytest.importorskip("transformers")
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from sweep.integrations.hf_trainer import ClipampCallback

    model = Probe()
    opt, sched = _opt_sched(model)
    args = TrainingArguments(output_dir="unused", max_grad_norm=0.0, use_cpu=True, report_to=[])
    state, control = TrainerState(max_steps=STEPS), TrainerControl()
    cb = ClipampCallback(tracking=None, verbose=False)
    cb.recorder.begin(total_steps=STEPS, user_tau=None, default_csv=None, main_process=False)
    cb._model, cb._user_tau = model, 0.0
    for c in norm_sequence():  # Trainer's hook order, without the Trainer
        cb.on_step_begin(args, state, control)
        model.w.grad = c.reshape(1).clone()
        cb.on_pre_optimizer_step(args, state, control, optimizer=opt)
        opt.step()
        cb.on_optimizer_step(args, state, control, optimizer=opt)
        sched.step()
        opt.zero_grad(set_to_none=True)
        state.global_step += 1
        cb.on_step_end(args, state, control)
    return cb.policy


def through_the_lightning_callback(tmp_path):
    L = pytest.importorskip("lightning")
    from sweep.integrations.lightning import ClipampCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.probe = Probe()

        def training_step(self, batch, batch_idx):
            return self.probe(batch[0])

        def configure_optimizers(self):
            opt, sched = _opt_sched(self.probe)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    data = torch.utils.data.TensorDataset(norm_sequence().reshape(STEPS, 1))
    cb = ClipampCallback(tracking=None, csv_path=tmp_path / "steps.csv", verbose=False)
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        callbacks=[cb],
        default_root_dir=str(tmp_path),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=1))
    return cb.policy


def _answer(policy):
    """What the policy concluded; its next action spelled as the app's, whichever front end built it."""
    own, policy.spelling = policy.spelling, APP_SPELLING
    s, check = policy.summaries[0], policy.checks()[0]
    policy.spelling = own
    return {
        "placement": policy.placement.as_dict(),
        "window": (s.start_step, s.end_step),
        "quantile": policy.quantile,
        "tau": s.recommended_max_norm,
        "interval": (s.tau_ci.low, s.tau_ci.high),
        "predicted": s.predicted_clip_ratio,
        "validation": (check.clipped, check.steps),
        "verdict": check.verdict,
        "action": check.action,
    }


@pytest.mark.slow  # 500 steps through each entry point, one of them a Lightning fit
def test_one_norm_sequence_gives_one_answer_at_every_entry_point(tmp_path):
    cfg = calibrated(compose_cfg("+experiment=calibrate"))
    assert cfg.steps == STEPS
    runner = through_the_engine(build_clip_policy(cfg, total_steps=cfg.steps))
    from sweep.integrations.hf_trainer import HF_SPELLING
    from sweep.integrations.lightning import LIGHTNING_SPELLING

    policies = {
        "own loop": (through_the_engine(recommended_calibration(total_steps=STEPS)), ENGINE),
        "hf callback": (through_the_hf_callback(), HF_SPELLING),
        "lightning callback": (through_the_lightning_callback(tmp_path), LIGHTNING_SPELLING),
    }
    assert runner.spelling == APP_SPELLING
    assert {name: p.spelling for name, (p, _) in policies.items()} == {n: sp for n, (_, sp) in policies.items()}
    answers = {name: _answer(p) for name, (p, _) in policies.items()}
    expected = _answer(runner)
    assert expected["placement"]["start"] > WARMUP  # the window waited for the warm-up and the transient
    assert expected["validation"][1] == STEPS - expected["window"][1]  # every later step checks τ
    for name, answer in answers.items():
        assert answer == expected, name


def test_the_own_loop_default_is_the_runners_calibrate_experiment():
    runner = build_clip_policy(calibrated(compose_cfg("+experiment=calibrate")), total_steps=STEPS)
    ours = recommended_calibration(total_steps=STEPS)
    keys = ("window", "every", "quantile", "candidates", "cap", "start", "validate", "band", "confidence")
    assert {k: getattr(ours, k) for k in keys} == {k: getattr(runner, k) for k in keys}
