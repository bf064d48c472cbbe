"""LoRA RL through PEFT: wrap the policy, name adapter and merged tensors for weight sync and export.

Only the adapters train. Weight sync then sends either the adapter tensors alone (engines that apply
adapters) or, per adapted module, the merged weight :math:`W + \\tfrac{\\alpha}{r} B A` under its Hugging
Face name (engines that load plain weights by name, like the embedded engine). Every other weight is
frozen and equal to what the engine loaded from the base model, so it is never sent.

Tensors pass through `full` before use: under FSDP2 that gathers a sharded parameter on every rank (a
collective), so every rank must walk these iterators in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from torch import Tensor, nn

from relax.config import LoraConfig

logger = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"
FullFn = Callable[[Tensor], Tensor]


def wrap_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """`model` with LoRA adapters on `cfg.target_modules`; only adapter parameters require grad."""
    import peft

    peft_cfg = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped = peft.get_peft_model(model, peft_cfg)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    logger.info(
        "LoRA r=%d: %d of %d parameters train (%.2f%%)", cfg.rank, trainable, total, 100 * trainable / total
    )
    return wrapped


def hf_name(peft_name: str) -> str:
    """`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` -> `model.layers.0...q_proj.weight`."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(".base_layer", "")


def _lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name, module


def merged_weights(model: nn.Module, full: FullFn) -> Iterator[tuple[str, Tensor]]:
    """(HF name, W + scaling * B @ A) of every adapted module, in fp32 or the base weight's dtype."""
    for name, module in _lora_layers(model):
        w = full(module.base_layer.weight)
        a = full(module.lora_A[ADAPTER].weight).float()  # [r, in]
        b = full(module.lora_B[ADAPTER].weight).float()  # [out, r]
        merged = w.float() + module.scaling[ADAPTER] * (b @ a)
        yield hf_name(name) + ".weight", merged.to(w.dtype)


def adapter_weights(model: nn.Module, full: FullFn) -> Iterator[tuple[str, Tensor]]:
    """(PEFT name, tensor) of every adapter parameter: the only tensors that change in LoRA training."""
    for name, p in model.named_parameters():
        if "lora_" in name:
            yield name, full(p)


def full_weights(model: nn.Module, full: FullFn) -> Iterator[tuple[str, Tensor]]:
    """Every weight under its HF name, adapted modules merged (what an engine holds after a sync)."""
    merged = dict(merged_weights(model, full))
    for name, t in model.state_dict().items():
        if "lora_" in name:
            continue
        key = hf_name(name)
        yield key, merged.pop(key) if key in merged else full(t)


def export_lora(model: nn.Module, out: Path, *, merge: bool) -> None:
    """Save a PEFT model as a merged HF folder (`merge=True`) or as a PEFT adapter folder."""
    if merge:
        model.merge_and_unload().save_pretrained(out)
    else:
        model.save_pretrained(out)
    logger.info("exported %s LoRA model to %s", "merged" if merge else "adapter-only", out)
