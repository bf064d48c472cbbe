"""Building the models a trainer holds, one way for every backend and role: the policy (in training mode,
with activation checkpointing and LoRA as configured), a frozen reference or ActorFwd copy, and the PPO
critic (a value head over the same architecture).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from relax.config import TrainerConfig
from relax.models.multimodal_model import load_causal_lm
from relax.models.numerics import use_float32_reductions

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, attention: str = "auto") -> torch.device:
    """`auto` -> cuda when this process sees a GPU, else cpu; any other name as given. On a GPU the
    process's attention kernel is set (`set_attention_kernel`) and its products reduce as the engine's do
    (`relax.models.numerics`)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        set_attention_kernel(attention)
        use_float32_reductions()
    return device


def set_attention_kernel(kind: str) -> None:
    """`trainer.attention_kernel` for this (trainer) process's SDPA calls: `cudnn` leaves cuDNN in SDPA's
    choice (torch then prefers it on Hopper and newer GPUs); `flash` and `auto` leave it out.

    cuDNN's kernels are faster, but it builds an execution plan for every new (rows, length) shape, and
    ragged RL micro-batches bring new shapes every step; over the first steps of a run the plans cost
    more than the kernels save (docs/trainer.md, Attention kernel, has the figures). The flash kernel
    needs no plan."""
    torch.backends.cuda.enable_cudnn_sdp(kind == "cudnn")


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder (and vision) layer's activations in backward; needs `model.train()`.

    transformers >= 5.2 names it `activation_checkpointing_enable` (the old name warns); both take the
    `torch.utils.checkpoint` options, here the non-reentrant variant that FSDP2 and `torch.compile` need.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def load_model(
    path: str,
    dtype: torch.dtype,
    cfg: TrainerConfig,
    *,
    trainable: bool,
    value_head: bool = False,
    lora: bool = False,
) -> nn.Module:
    """The model of folder `path` in `dtype`, on the CPU.

    trainable: training mode (`from_pretrained` returns eval mode, and Hugging Face layers checkpoint
    only in training mode: without it `gradient_checkpointing` kept every activation) with activation
    checkpointing if `cfg.gradient_checkpointing`; otherwise eval mode with every weight frozen.
    lora: wrap with `cfg.lora`'s adapters (only they train). value_head: a `ValueHeadModel` (PPO critic)
    over the loaded model, its head in `dtype`."""
    model: nn.Module = load_causal_lm(path, dtype=dtype)
    if trainable:
        model.train()
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(model)
        if lora and cfg.lora is not None:
            from relax.backends.training.lora import wrap_lora  # PEFT: only for LoRA runs

            model = wrap_lora(model, cfg.lora)
    if value_head:
        from relax.algorithms.critic import ValueHeadModel

        model = ValueHeadModel(model).to(dtype)
    if not trainable:
        model.eval().requires_grad_(False)
    return model


def layer_types(model: nn.Module) -> set[str]:
    """Class names of the model's repeated blocks (decoder and vision layers): the units FSDP shards and
    `compile_layers` compiles. A `ValueHeadModel` reports its backbone's; a PEFT wrapper forwards the
    attribute to its base model."""
    for m in (model, getattr(model, "backbone", None)):
        names = getattr(m, "_no_split_modules", None) if m is not None else None
        if names:
            return set(names)
    return set()
