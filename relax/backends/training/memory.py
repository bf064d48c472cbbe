"""Micro-batch size and activation checkpointing chosen from the model's size and the free GPU memory,
so that a model that fits one GPU trains there with no tuning (`trainer.max_tokens_per_micro_batch` and
`trainer.gradient_checkpointing` left at None; an explicit value always wins).

On CPU: 8192-token micro-batches, no checkpointing. On a GPU the trainer decides at its first forward or
update, when the engine it may share the GPU with (colocate) already holds its weights and KV cache:

    usable  = free memory (the device's, plus what this process's allocator holds unused)
              - a reserve (6% of the GPU, at least 2 GiB: later growth of the engine's cache, fragmentation)
    pending = what the first update still allocates: gradients (4 B per trainable parameter) and, before
              the first optimizer step, AdamW's two moments (8 B)
    tokens  = (usable - pending - head) / activation bytes per token

For one token the activations kept for backward are, per decoder layer of hidden size H, key/value width
Hkv and MLP width I (bf16 compute, fp32 RMSNorm inputs), about 20 H + 4 Hkv + 8 I bytes: both norms'
fp32 inputs and bf16 outputs, the rotated queries and keys, values, the attention output, and the MLP's
gate, up, activation and product. With activation checkpointing a layer keeps only its input (2 H) and
one layer's activations exist at a time. `head` is the chunked log-prob head's working set
(`logprobs.CHUNK_TOKENS` x vocabulary x 12 B: fp32 logits, probabilities and a bf16 gradient).

Without checkpointing when that leaves micro-batches of at least `MIN_TOKENS_PLAIN` tokens; with it
otherwise; at most `MAX_TOKENS`. If not even `MIN_TOKENS` fit with checkpointing, or the weights and
optimizer states alone exceed the GPU, the trainer stops with an error naming the knobs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from relax.backends.training.logprobs import CHUNK_TOKENS
from relax.config import TrainerConfig
from relax.models.multimodal_model import is_multimodal

logger = logging.getLogger(__name__)

GiB = 2**30
CPU_TOKENS = 8192  # the CPU's micro-batch budget (auto)
FORWARD_TOKENS = 16384  # a forward-only role's (ActorFwd, Reference) budget on a GPU (auto)
MAX_TOKENS = 65536  # larger micro-batches gain nothing measurable and delay the first backward
MIN_TOKENS_PLAIN = 8192  # below this, checkpointing with larger micro-batches is the faster choice
MIN_TOKENS = 1024  # the least a plan may give before the trainer refuses to start
RESERVE_FRACTION, RESERVE_MIN = 0.06, 2 * GiB
KNOBS = (
    "trainer.num_ranks (shard over more GPUs), trainer.lora (train adapters only), "
    "resources.engine_gpus / rollout.engine_max_running (a smaller engine beside the trainer), or set "
    "trainer.max_tokens_per_micro_batch and trainer.gradient_checkpointing=true yourself"
)


@dataclass(frozen=True)
class MemoryPlan:
    tokens: int  # token budget of a micro-batch (padded tokens count)
    checkpointing: bool  # activation checkpointing on
    why: str  # one line for the log


def _text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def activation_bytes(model: nn.Module, checkpointing: bool, compute_bytes: int = 2) -> int:
    """Activation bytes kept for backward per token (module docstring); fp32 compute doubles them."""
    c = _text_config(model)
    H, L = int(c.hidden_size), int(c.num_hidden_layers)
    heads = int(c.num_attention_heads)
    head_dim = int(getattr(c, "head_dim", None) or H // heads)
    Hkv = int(getattr(c, "num_key_value_heads", None) or heads) * head_dim
    I = int(getattr(c, "intermediate_size", None) or 4 * H)  # noqa: E741 - the usual name of the MLP width
    layer = (20 * H + 4 * Hkv + 8 * I) * compute_bytes // 2
    outside = 10 * H  # embedding output, final norm, the hidden states the head reads
    if checkpointing:
        return L * H * compute_bytes + layer + outside
    return L * layer + outside


def head_bytes(model: nn.Module) -> int:
    return CHUNK_TOKENS * int(_text_config(model).vocab_size) * 12


def free_bytes(device: torch.device) -> tuple[int, int]:
    """(bytes this process may still allocate on `device`, the device's total)."""
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + held, total


def check_static_fit(trainable_bytes: int, held_bytes: int, device: torch.device) -> None:
    """At start-up: the weights, gradients and AdamW states must fit the GPU at all (before step 1)."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    need = held_bytes + 3 * trainable_bytes  # + gradients + two moments (fp32, like the weights)
    if need > total - max(RESERVE_MIN, RESERVE_FRACTION * total):
        raise RuntimeError(
            f"trainer: the weights, gradients and AdamW states need {need / GiB:.1f} GiB on each rank and the "
            f"GPU has {total / GiB:.1f} GiB in all, before any activation or engine. Use {KNOBS}"
        )


def plan_memory(
    cfg: TrainerConfig,
    device: torch.device,
    model: nn.Module,
    pending_bytes: int,
    compute_bytes: int = 2,
) -> MemoryPlan:
    """The micro-batch budget and checkpointing for `model` on `device` (explicit settings kept)."""
    tokens, ckpt = cfg.max_tokens_per_micro_batch, cfg.gradient_checkpointing
    model = getattr(model, "backbone", model)  # a critic: its backbone's shape
    if device.type != "cuda":
        return MemoryPlan(tokens or CPU_TOKENS, bool(ckpt), "CPU defaults")
    if tokens is not None and ckpt is not None:
        return MemoryPlan(tokens, ckpt, "set in the config")
    free, total = free_bytes(device)
    reserve = max(RESERVE_MIN, int(RESERVE_FRACTION * total))
    room = free - reserve - pending_bytes - head_bytes(model)
    if ckpt is None and is_multimodal(model):
        ckpt = True  # the encoders' activations are not in the estimate: keep the decoder's small
    per_plain, per_ckpt = (activation_bytes(model, c, compute_bytes) for c in (False, True))
    fit_plain, fit_ckpt = max(0, room // per_plain), max(0, room // per_ckpt)
    if ckpt is None:
        ckpt = fit_plain < (tokens if tokens is not None else MIN_TOKENS_PLAIN)
    fit = fit_ckpt if ckpt else fit_plain
    if tokens is None:
        tokens = int(min(MAX_TOKENS, fit))
        if tokens < MIN_TOKENS:
            raise RuntimeError(
                f"trainer: {free / GiB:.1f} GiB of the GPU's {total / GiB:.1f} GiB are free beside the engine; "
                f"the first update still allocates {pending_bytes / GiB:.1f} GiB of gradients and optimizer "
                f"states, which leaves micro-batches of {tokens} tokens even with activation checkpointing. "
                f"Use {KNOBS}"
            )
    elif tokens > fit:
        logger.warning(
            "trainer.max_tokens_per_micro_batch=%d may not fit: about %d tokens do %s activation checkpointing",
            tokens,
            fit,
            "with" if ckpt else "without",
        )
    why = (
        f"{free / GiB:.1f} GiB free of {total / GiB:.1f}, {pending_bytes / GiB:.1f} GiB still to allocate, "
        f"{(per_ckpt if ckpt else per_plain) / 2**10:.0f} KiB of activations per token"
    )
    return MemoryPlan(int(tokens), bool(ckpt), why)


def forward_tokens(cfg: TrainerConfig, device: torch.device) -> int:
    """The micro-batch budget of a forward-only role (no activations kept)."""
    if cfg.max_tokens_per_micro_batch is not None:
        return cfg.max_tokens_per_micro_batch
    return FORWARD_TOKENS if device.type == "cuda" else CPU_TOKENS


def pending_update_bytes(optimizer: torch.optim.Optimizer, reduce_once: bool = False) -> int:
    """Bytes the next update still allocates: gradients, and AdamW's moments before its first step.
    `reduce_once` (`Trainable.reduce_once`): FSDP also holds the unsharded gradients it accumulates."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = sum(_local_numel(p) * p.element_size() for p in params)
    return local * ((1 if optimizer.state else 3) + int(reduce_once))


def _local_numel(p: torch.Tensor) -> int:
    """Elements this rank holds (a DTensor's local shard)."""
    to_local = getattr(p, "to_local", None)
    return to_local().numel() if to_local is not None else p.numel()
