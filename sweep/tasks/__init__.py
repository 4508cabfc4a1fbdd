"""Training tasks: byte-level LMs (gpt, lstm, custom) on stdlib/text, linear on synthetic, and
``model=hf`` (any transformers causal LM) on tokenized text (``data=hf`` files, stdlib, text).

    from sweep.tasks.build import build_task
    task = build_task(ModelConfig(), DataConfig(), seed=0)
    batch = next(task.train_batches)
    loss_sum, n_tokens = task.loss_fn(task.model(batch.inputs), batch.targets)

The package imports none of its modules: importing one module (``corpus``, ``hf_data``) does not
load the others.
"""
