"""``model=hf``: an encoder (BERT, RoBERTa) is refused in one line instead of training as a causal LM
that sees its targets; a checkpoint whose weights do not fit its config.json is one line naming a
weight, with nothing of transformers' load report printed; long causes are cut at a word."""

from __future__ import annotations

import json

import pytest

from sweep.config.schema import ModelConfig
from sweep.errors import UserError, clip_words
from sweep.tasks.hf_model import build

SIZES = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64
)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_an_encoder_config_is_refused(model_type, capfd):
    with pytest.raises(UserError) as e:
        build(ModelConfig(name="hf", config={"model_type": model_type, **SIZES}), 300)
    assert str(e.value).startswith(f"model.config.model_type={model_type!r} is ") and "an encoder" in str(e.value)
    assert "clipamp trains causal LMs only" in str(e.value)
    assert capfd.readouterr().err == ""  # transformers' "add is_decoder=True" warning is not printed


def test_an_encoder_with_causal_attention_is_accepted():
    model = build(ModelConfig(name="hf", config={"model_type": "bert", "is_decoder": True, **SIZES}), 300)
    assert model.config.is_decoder


def test_a_pretrained_bert_is_refused(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(vocab_size=300, **SIZES)).save_pretrained(tmp_path / "bert")
    with pytest.raises(UserError) as e:
        build(ModelConfig(name="hf", pretrained=str(tmp_path / "bert")), 300)
    assert str(e.value).startswith(f"model.pretrained='{tmp_path / 'bert'}' is BertLMHeadModel, an encoder")


def test_weights_that_do_not_fit_the_config_are_one_line(tmp_path, capfd):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, num_key_value_heads=2, **SIZES)).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    capfd.readouterr()
    with pytest.raises(UserError) as e:
        build(ModelConfig(name="hf", pretrained=str(path)), 300)
    assert "3 saved weights do not fit its config.json, e.g. model.layers.0.mlp." in str(e.value), str(e.value)
    assert "[64, 32], config [48, 32]" in str(e.value) or "[32, 64], config [32, 48]" in str(e.value)
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "Loading weights" not in err, err


def test_long_causes_are_cut_at_a_word():
    text = "word " * 100
    cut = clip_words(text, 300)
    assert len(cut) <= 302 and cut.endswith("word …") and clip_words("short text") == "short text"


def test_a_preset_key_the_new_model_type_lacks_is_refused_naming_its_own_name():
    """``model=hf model.config.model_type=opt``: OPTConfig has no intermediate_size nor num_key_value_heads
    (the Llama preset's); transformers kept them as unused attributes and built OPT's ffn_dim=3072, a
    3.53M-parameter model instead of the preset's sizes, saying nothing. Refused, naming the keys to drop and
    OPT's name for the size; the model those overrides build is OPT's own at the preset's sizes."""
    import yaml
    from transformers import OPTConfig, OPTForCausalLM

    preset = yaml.safe_load(open("conf/model/hf.yaml"))["config"]
    with pytest.raises(UserError) as e:
        build(ModelConfig(name="hf", config={**preset, "model_type": "opt"}), 300)
    said = str(e.value)
    assert said.startswith("model.config.model_type=opt (OPTConfig) has no model.config.intermediate_size, ")
    assert "drop them: ~model.config.intermediate_size ~model.config.num_key_value_heads" in said, said
    assert said.endswith("+model.config.ffn_dim=384") and "\n" not in said, said
    fixed = {k: v for k, v in preset.items() if k not in ("intermediate_size", "num_key_value_heads")}
    model = build(ModelConfig(name="hf", config={**fixed, "model_type": "opt", "ffn_dim": 384}), 300)
    sizes = {k: v for k, v in fixed.items() if k not in ("model_type", "vocab_size")}
    reference = OPTForCausalLM(OPTConfig(vocab_size=300, ffn_dim=384, **sizes))
    assert [(n, p.shape) for n, p in model.named_parameters()] == [
        (n, p.shape) for n, p in reference.named_parameters()
    ]
    # mapped names (GPT2Config's attribute_map) and the keys transformers consumes are accepted
    build(
        ModelConfig(
            name="hf",
            config={
                "model_type": "gpt2",
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "attn_implementation": "eager",
            },
        ),
        300,
    )
