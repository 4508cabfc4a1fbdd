"""A plain transformers Trainer run with ClipampCallback: a tiny Llama on examples/docstrings.jsonl.

    .venv/bin/python examples/make_docstrings.py
    .venv/bin/python examples/trainer_callback.py

Writes steps.csv into an MLflow run (sqlite:///mlruns/mlflow.db), prints the recommended
max_grad_norm after the 60-step window and clips at it from then on (apply=True); saves the
model and its tokenizer to outputs/trainer-example/model (a model.pretrained= directory).
Offline; a few minutes on 2 CPU cores (2m42s of CPU time measured).
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import load_dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from sweep.integrations.hf_trainer import ClipampCallback

DATA, OUT = "examples/docstrings.jsonl", "outputs/trainer-example"

texts = load_dataset("json", data_files=DATA, split="train")
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
bpe.train_from_iterator(
    texts["text"],
    trainers.BpeTrainer(
        vocab_size=2048, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    ),
)
tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
train = texts.map(
    lambda b: tok(b["text"], truncation=True, max_length=64), batched=True, remove_columns=texts.column_names
)

config = AutoConfig.for_model(
    "llama",
    vocab_size=len(tok),
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
args = TrainingArguments(
    output_dir=OUT,
    max_steps=120,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    warmup_steps=10,
    max_grad_norm=1.0,
    bf16=True,
    use_cpu=True,
    logging_steps=30,
    save_strategy="no",
    report_to=[],
    disable_tqdm=True,
)
trainer = Trainer(
    model=AutoModelForCausalLM.from_config(config),
    args=args,
    train_dataset=train,
    data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
    callbacks=[ClipampCallback(window=60, apply=True)],
)
trainer.train()
trainer.save_model(f"{OUT}/model")
tok.save_pretrained(f"{OUT}/model")
print(f"saved {OUT}/model")
