"""Tiny random-initialised Qwen checkpoints written to disk, for tests and CPU toy runs.

`write_tiny_model` writes a folder that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load exactly as a real Qwen checkpoint: `config.json`,
`model.safetensors`, `generation_config.json` and the tokenizer files (with Qwen2.5's chat template).

Multimodal families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni and Qwen3-Omni thinkers) also write
`preprocessor_config.json` (image processor / feature extractor); their configs live in
`relax.models.tiny_multimodal`. To add a model family: write a function that turns `TinyDims` plus the
tokenizer into that family's config, and register a `TinyFamily` in `TINY_FAMILIES`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
)

from relax.models import tiny_multimodal as mm
from relax.models.tokenizer import EOS_TOKEN, PAD_TOKEN, train_tiny_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class TinyDims:
    """Sizes of a tiny model; every family reads the fields it has."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 2048


@dataclass(frozen=True)
class TinyFamily:
    """How to build one model family: its config from the sizes and token ids, and its model class."""

    build_config: Callable[[TinyDims, PreTrainedTokenizerBase], PretrainedConfig]
    model_class: type[PreTrainedModel]
    # file name -> JSON written beside the weights (the processor configs of multimodal families)
    processor_files: Callable[[PretrainedConfig], dict[str, dict]] | None = None


def _token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Qwen's convention: bos = pad = <|endoftext|>, eos = <|im_end|>."""
    pad = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    return {
        "bos_token_id": pad,
        "pad_token_id": pad,
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS_TOKEN),
    }


def _common(dims: TinyDims) -> dict:
    return {
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_kv_heads,
        "max_position_embeddings": dims.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "use_cache": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }


def _qwen2_config(dims: TinyDims, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    return Qwen2Config(**_common(dims), **_token_ids(tokenizer), max_window_layers=dims.num_layers)


def _qwen3_config(dims: TinyDims, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    head_dim = dims.hidden_size // dims.num_heads
    return Qwen3Config(
        **_common(dims), **_token_ids(tokenizer), head_dim=head_dim, max_window_layers=dims.num_layers
    )


# The registry of tiny model families: name -> how to build it.
TINY_FAMILIES: dict[str, TinyFamily] = {
    "qwen2": TinyFamily(_qwen2_config, Qwen2ForCausalLM),
    "qwen3": TinyFamily(_qwen3_config, Qwen3ForCausalLM),
    "qwen2_vl": TinyFamily(mm.qwen2_vl_config, Qwen2VLForConditionalGeneration, mm.vision_processor_files),
    "qwen2_5_vl": TinyFamily(
        mm.qwen2_5_vl_config, Qwen2_5_VLForConditionalGeneration, mm.vision_processor_files
    ),
    "qwen3_vl": TinyFamily(mm.qwen3_vl_config, Qwen3VLForConditionalGeneration, mm.vision_processor_files),
    "qwen2_5_omni": TinyFamily(
        mm.qwen2_5_omni_thinker_config, Qwen2_5OmniThinkerForConditionalGeneration, mm.omni_processor_files
    ),
    "qwen3_omni": TinyFamily(
        mm.qwen3_omni_thinker_config, Qwen3OmniMoeThinkerForConditionalGeneration, mm.omni_processor_files
    ),
}


def get_family(family: str) -> TinyFamily:
    """The registered family `family`, or a ValueError that lists the valid names."""
    try:
        return TINY_FAMILIES[family]
    except KeyError:
        valid = ", ".join(sorted(TINY_FAMILIES))
        raise ValueError(
            f"unknown tiny model family {family!r}; valid families: {valid} "
            "(to add one, register a TinyFamily in relax.models.tiny.TINY_FAMILIES)"
        ) from None


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (a tied embedding and LM head count once)."""
    return sum(p.numel() for p in model.parameters())


def write_tiny_model(
    out_dir: str | Path,
    family: str = "qwen2",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    tokenizer: PreTrainedTokenizerBase | None = None,
    init_std: float | None = None,
    device: str = "cpu",
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a random-initialised `family` checkpoint with a tiny tokenizer to `out_dir`; return the path.

    `intermediate_size` defaults to 4 * hidden_size. With the defaults a Qwen2 model has about 0.16 M
    parameters. Pass `tokenizer` to reuse one (it must have at most `vocab_size` tokens); otherwise a
    tokenizer of `vocab_size` tokens is trained. Same arguments and seed give the same weights.
    `init_std` overrides the family's `initializer_range` (0.02): the std of every linear and embedding
    weight. With tied embeddings and a frozen head (LoRA) the logits are bounded by
    sqrt(hidden_size) * |embedding row|, so a random base needs a larger std to let adapters sharpen it.
    `device`: where the weights are initialised (a GPU writes billion-parameter shapes far sooner).
    `max_position_embeddings`: the context; a benchmark of long responses needs Qwen2.5's 32768.
    """
    spec = get_family(family)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}), "
            f"and num_heads by num_kv_heads ({num_kv_heads})"
        )
    tokenizer = tokenizer if tokenizer is not None else train_tiny_tokenizer(vocab_size)
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={vocab_size}")
    dims = TinyDims(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size or 4 * hidden_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
    )
    config = spec.build_config(dims, tokenizer)
    config.dtype = dtype
    if init_std is not None:
        if init_std <= 0:
            raise ValueError(f"init_std must be positive, got {init_std}")
        for c in (config, getattr(config, "text_config", None)):
            if c is not None:
                c.initializer_range = init_std
    with torch.random.fork_rng(devices=[] if device == "cpu" else [torch.device(device).index or 0]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = spec.model_class(config).to(_DTYPES[dtype])
    ids = _token_ids(tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        pad_token_id=ids["pad_token_id"],
        eos_token_id=[ids["eos_token_id"], ids["pad_token_id"]],  # <|im_end|>, <|endoftext|>
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for name, content in (spec.processor_files(config) if spec.processor_files else {}).items():
        (out / name).write_text(json.dumps(content, indent=2))
    logger.info("wrote tiny %s model (%d parameters) to %s", family, count_parameters(model), out)
    return out
