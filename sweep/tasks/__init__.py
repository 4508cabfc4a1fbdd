"""Training tasks: byte-level LMs (gpt, lstm, custom) on stdlib/text, linear on synthetic, and
``model=hf`` (any transformers causal LM) on tokenized text (``data=hf`` files, stdlib, text).

    task = build_task(ModelConfig(), DataConfig(), seed=0)
    batch = next(task.train_batches)
    loss_sum, n_tokens = task.loss_fn(task.model(batch.inputs), batch.targets)
"""

from ..config.schema import DataConfig, ModelConfig
from .build import Batch, Task, build_task, evaluate, lm_loss, mse_loss

__all__ = ["Batch", "DataConfig", "ModelConfig", "Task", "build_task", "evaluate", "lm_loss", "mse_loss"]
