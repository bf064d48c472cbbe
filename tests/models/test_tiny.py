"""The in-process Qwen-style tokenizer and the tiny checkpoint writer."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.models.tiny import TINY_FAMILIES, count_parameters, get_family, write_tiny_model
from relax.models.tokenizer import ADDED_TOKENS, SPECIAL_TOKENS, train_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tiny_tokenizer(512)


def test_vocab_size_and_special_ids(tok):
    assert len(tok) == 512
    ids = tok.convert_tokens_to_ids(list(SPECIAL_TOKENS + ADDED_TOKENS))
    # Specials follow the BPE vocabulary in Qwen's order.
    assert ids == list(range(512 - len(ids), 512))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    for t in SPECIAL_TOKENS + ADDED_TOKENS:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld",
        "你好，世界 🎉🚀",
        "tabs\tand\nnewlines\r\n  ",
        "Ω≈ç√∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
        "\x00\x7f\u200b",
        "a" * 50,
    ],
)
def test_round_trip_unicode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_all_bytes_in_alphabet(tok):
    vocab = tok.get_vocab()
    from tokenizers.pre_tokenizers import ByteLevel

    assert all(ch in vocab for ch in ByteLevel.alphabet())


def test_digits_split(tok):
    ids = tok.encode("12+345=357", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == list("12+345=357")


def test_special_tokens_not_split_and_skipped(tok):
    text = "<|im_start|>user\nhi<|im_end|><think>x</think>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text
    # <think> is an added, non-special token: kept when skipping special tokens, as in Qwen.
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi<think>x</think>"


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "3+4="}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    )
    msgs = [{"role": "system", "content": "S"}, *msgs, {"role": "assistant", "content": "7"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert (
        text
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n"
    )


def test_chat_template_tools(tok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    msgs = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n'
        in text
    )
    assert (
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_tiny_model_round_trip(tmp_path, tok, family):
    out = write_tiny_model(tmp_path / family, family, tokenizer=tok, seed=1)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(out)
    loaded_tok = AutoTokenizer.from_pretrained(out)
    assert type(model) is TINY_FAMILIES[family].model_class
    assert 100_000 <= count_parameters(model) <= 300_000
    assert model.config.tie_word_embeddings and model.config.max_position_embeddings == 2048
    assert model.generation_config.eos_token_id == [tok.eos_token_id, tok.pad_token_id]
    text = "<|im_start|>user\n1+2=<|im_end|>"
    assert loaded_tok.encode(text) == tok.encode(text)
    assert loaded_tok.chat_template == tok.chat_template

    ids = loaded_tok.apply_chat_template(
        [{"role": "user", "content": "1+2="}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], 512) and torch.isfinite(logits).all()
    out_ids = model.generate(**ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out_ids.shape == (1, ids["input_ids"].shape[1] + 4)


def test_same_seed_same_weights(tmp_path, tok):
    a = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "a", tokenizer=tok, seed=3))
    b = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "b", tokenizer=tok, seed=3))
    c = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "c", tokenizer=tok, seed=4))
    pa, pb, pc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_bad_family(tmp_path):
    with pytest.raises(
        ValueError,
        match="unknown tiny model family 'llama'; valid families: qwen2, qwen2_5_omni, qwen2_5_vl, qwen2_vl, qwen3,",
    ):
        write_tiny_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="valid families"):
        get_family("qwen9")


def test_init_std_sets_the_weight_scale(tmp_path, tok):
    """`init_std` scales every linear and embedding weight (a sharper random head for LoRA bases)."""
    default = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "d", tokenizer=tok))
    sharp = AutoModelForCausalLM.from_pretrained(
        write_tiny_model(tmp_path / "s", tokenizer=tok, init_std=0.3)
    )
    for model, std in ((default, 0.02), (sharp, 0.3)):
        for w in (model.model.embed_tokens.weight, model.model.layers[0].mlp.up_proj.weight):
            assert abs(float(w.std()) - std) < 0.1 * std
    with pytest.raises(ValueError, match="init_std must be positive"):
        write_tiny_model(tmp_path / "bad", tokenizer=tok, init_std=0.0)
