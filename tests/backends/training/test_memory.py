"""Micro-batch size and activation checkpointing from the model's size and the free GPU memory
(`memory.py`), against the formulas worked out by hand for Qwen2.5-1.5B's shape."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config

from relax.backends.training import memory
from relax.config import TrainerConfig

GiB = 2**30
# Qwen2.5-1.5B: hidden 1536, 28 layers, 12 heads of 128 (2 for keys/values), MLP 8960, vocab 151936
SHAPE = dict(
    hidden_size=1536,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    intermediate_size=8960,
    vocab_size=151936,
)
LAYER = 20 * 1536 + 4 * 256 + 8 * 8960  # bytes per token per layer: 103,424
PLAIN = 28 * LAYER + 10 * 1536  # 2,911,232 bytes per token
CKPT = 28 * 1536 * 2 + LAYER + 10 * 1536  # 204,800 bytes per token
HEAD = 4096 * 151936 * 12  # the chunked head's working set
TOTAL = 139 * GiB
RESERVE = int(0.06 * TOTAL)
PENDING = int(1.54e9 * 12)  # gradients and AdamW moments of 1.54 B fp32 parameters
CUDA = torch.device("cuda", 0)


@pytest.fixture
def model():
    return SimpleNamespace(config=Qwen2Config(**SHAPE))


@pytest.fixture
def free(monkeypatch):
    def set_free(n: int) -> None:
        monkeypatch.setattr(memory, "free_bytes", lambda device: (n, TOTAL))

    return set_free


def test_activation_bytes_by_hand(model):
    assert memory.activation_bytes(model, checkpointing=False) == PLAIN
    assert memory.activation_bytes(model, checkpointing=True) == CKPT
    assert memory.activation_bytes(model, checkpointing=False, compute_bytes=4) == 28 * 2 * LAYER + 15360
    assert memory.head_bytes(model) == HEAD


def test_room_for_plain_micro_batches_keeps_checkpointing_off(model, free):
    free(120 * GiB)  # a 139 GiB GPU beside a 19 GiB engine
    plan = memory.plan_memory(TrainerConfig(), CUDA, model, PENDING)
    want = (120 * GiB - RESERVE - PENDING - HEAD) // PLAIN
    assert not plan.checkpointing and plan.tokens == want and 30_000 < want < 33_000


def test_little_room_turns_checkpointing_on(model, free):
    free(40 * GiB)  # plain micro-batches would hold ~2.2k tokens
    assert (40 * GiB - RESERVE - PENDING - HEAD) // PLAIN < memory.MIN_TOKENS_PLAIN
    plan = memory.plan_memory(TrainerConfig(), CUDA, model, PENDING)
    assert plan.checkpointing and plan.tokens == (40 * GiB - RESERVE - PENDING - HEAD) // CKPT
    free(500 * GiB)  # never more than MAX_TOKENS
    assert memory.plan_memory(TrainerConfig(), CUDA, model, PENDING).tokens == memory.MAX_TOKENS


def test_no_room_fails_naming_the_knobs(model, free):
    free(30 * GiB)
    with pytest.raises(RuntimeError, match="trainer.num_ranks.*trainer.lora.*max_tokens_per_micro_batch"):
        memory.plan_memory(TrainerConfig(), CUDA, model, PENDING)


def test_explicit_settings_win(model, free):
    free(40 * GiB)
    cfg = TrainerConfig(max_tokens_per_micro_batch=4096, gradient_checkpointing=False)
    plan = memory.plan_memory(cfg, CUDA, model, PENDING)
    assert (plan.tokens, plan.checkpointing) == (4096, False)
    # a budget alone: checkpointing only if that budget does not fit without it
    assert (
        memory.plan_memory(TrainerConfig(max_tokens_per_micro_batch=2048), CUDA, model, PENDING).checkpointing
        is False
    )
    assert memory.plan_memory(
        TrainerConfig(max_tokens_per_micro_batch=4096), CUDA, model, PENDING
    ).checkpointing
    cpu = memory.plan_memory(TrainerConfig(), torch.device("cpu"), model, PENDING)
    assert (cpu.tokens, cpu.checkpointing) == (memory.CPU_TOKENS, False)


def test_weights_and_optimizer_that_cannot_fit_fail_at_start(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=TOTAL))
    nine_b = int(9e9 * 4)  # fp32 weights of a 9 B model: 16 B a parameter with gradients and moments
    with pytest.raises(RuntimeError, match="AdamW states need 134.1 GiB.*trainer.num_ranks"):
        memory.check_static_fit(nine_b, nine_b, CUDA)
    memory.check_static_fit(int(1.54e9 * 4), int(1.54e9 * 4), CUDA)  # 1.5 B fits


def test_pending_counts_gradients_and_moments_until_the_first_step():
    p = torch.nn.Parameter(torch.zeros(10))
    opt = torch.optim.AdamW([p])
    assert memory.pending_update_bytes(opt) == 3 * 40
    p.grad = torch.ones(10)
    opt.step()
    assert memory.pending_update_bytes(opt) == 40
