"""Tiny random-initialised multimodal Qwen checkpoints: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the thinkers of
Qwen2.5-Omni and Qwen3-Omni (MoE), each with a vision encoder (and the Omni ones an audio encoder) of a few
ten thousand parameters.

Each family is a `TinyFamily` of `relax.models.tiny` whose config builder maps the Qwen media tokens of
the tiny tokenizer (`<|vision_start|>`, `<|image_pad|>`, `<|video_pad|>`, `<|audio_start|>`,
`<|audio_pad|>`, ...) to the config's token ids, and whose `processor_config` is written as
`preprocessor_config.json`: the `Qwen2VLImageProcessor` fields and, for the Omni thinkers, the
`WhisperFeatureExtractor` fields in the same file, as the real checkpoints ship them.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import (
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5OmniThinkerConfig,
    Qwen2VLConfig,
    Qwen3OmniMoeThinkerConfig,
    Qwen3VLConfig,
)

logger = logging.getLogger(__name__)

PATCH_SIZE = 14  # vision patch side (pixels); 16 for Qwen3 families, as in the real models
MERGE_SIZE = 2  # spatial_merge_size: merge x merge patches become one LLM token
TEMPORAL_PATCH = 2  # frames per temporal patch (an image is repeated to fill it)


def media_token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """The tiny tokenizer's media tokens by config field name."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
        "audio_token_id": ids("<|audio_pad|>"),
        "audio_start_token_id": ids("<|audio_start|>"),
        "audio_end_token_id": ids("<|audio_end|>"),
    }


def _text(dims: Any, tokenizer: PreTrainedTokenizerBase, **extra: Any) -> dict[str, Any]:
    """Text-decoder fields shared by the families (mrope sections sum to head_dim / 2)."""
    from relax.models.tiny import _common, _token_ids

    head_dim = dims.hidden_size // dims.num_heads
    half = head_dim // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # e.g. [2, 3, 3] for head_dim 16
    cfg = {**_common(dims), **_token_ids(tokenizer), **extra}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": section}
    cfg.pop("tie_word_embeddings", None)
    return cfg


def _vision(dims: Any, patch: int = PATCH_SIZE) -> dict[str, Any]:
    return {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": patch,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH,
        "out_hidden_size": dims.hidden_size,
        "initializer_range": 0.02,
    }


def _audio(dims: Any) -> dict[str, Any]:
    return {
        "num_mel_bins": 128,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": dims.hidden_size,
        "max_source_positions": 1500,
    }


def qwen2_vl_config(dims: Any, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    ids = media_token_ids(tokenizer)
    vision = {
        "depth": 1,
        "embed_dim": 32,
        "hidden_size": dims.hidden_size,
        "mlp_ratio": 2,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH,
    }
    return Qwen2VLConfig(
        text_config=_text(dims, tokenizer, max_window_layers=dims.num_layers),
        vision_config=vision,
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=True,
    )


def qwen2_5_vl_config(dims: Any, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    ids = media_token_ids(tokenizer)
    vision = {**_vision(dims), "window_size": 112, "fullatt_block_indexes": [0], "tokens_per_second": 2}
    return Qwen2_5_VLConfig(
        text_config=_text(dims, tokenizer, max_window_layers=dims.num_layers),
        vision_config=vision,
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=True,
    )


def qwen3_vl_config(dims: Any, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    ids = media_token_ids(tokenizer)
    text = _text(dims, tokenizer, head_dim=dims.hidden_size // dims.num_heads)
    text["rope_parameters"]["mrope_interleaved"] = True
    vision = {**_vision(dims, patch=16), "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=True,
    )


def qwen2_5_omni_thinker_config(dims: Any, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    ids = media_token_ids(tokenizer)
    vision = {**_vision(dims), "window_size": 112, "fullatt_block_indexes": [0]}
    cfg = Qwen2_5OmniThinkerConfig(
        text_config=_text(dims, tokenizer, max_window_layers=dims.num_layers),
        vision_config=vision,
        audio_config={**_audio(dims), "n_window": 100},
        audio_token_index=ids["audio_token_id"],
        image_token_index=ids["image_token_id"],
        video_token_index=ids["video_token_id"],
        audio_start_token_id=ids["audio_start_token_id"],
        audio_end_token_id=ids["audio_end_token_id"],
        tie_word_embeddings=True,
    )
    cfg.vision_start_token_id = ids["vision_start_token_id"]  # read by get_rope_index, as in the real config
    cfg.vision_end_token_id = ids["vision_end_token_id"]
    return cfg


def qwen3_omni_thinker_config(dims: Any, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    ids = media_token_ids(tokenizer)
    text = _text(dims, tokenizer, head_dim=dims.hidden_size // dims.num_heads)
    text["rope_parameters"]["mrope_interleaved"] = True
    text.update(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=dims.hidden_size, decoder_sparse_step=1
    )
    text.pop("max_window_layers", None)
    vision = {**_vision(dims, patch=16), "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    audio = {**_audio(dims), "n_window": 50, "downsample_hidden_size": 8, "n_window_infer": 400}
    cfg = Qwen3OmniMoeThinkerConfig(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        audio_token_id=ids["audio_token_id"],
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        audio_start_token_id=ids["audio_start_token_id"],
        tie_word_embeddings=True,
    )
    cfg.vision_start_token_id = ids["vision_start_token_id"]
    cfg.vision_end_token_id = ids["vision_end_token_id"]
    cfg.audio_end_token_id = ids["audio_end_token_id"]
    return cfg


def image_processor_config(config: PretrainedConfig) -> dict[str, Any]:
    """`Qwen2VLImageProcessor` fields matching the config's vision encoder; small images (<= 112x112)."""
    vision = config.vision_config
    factor = vision.patch_size * vision.spatial_merge_size
    mean_std = (
        ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
        if vision.patch_size == 16
        else ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])
    )
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": mean_std[0],
        "image_std": mean_std[1],
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.spatial_merge_size,
        "min_pixels": factor * factor,
        "max_pixels": (4 * factor) ** 2,
        "size": {"shortest_edge": factor * factor, "longest_edge": (4 * factor) ** 2},
    }


def audio_processor_config() -> dict[str, Any]:
    """`WhisperFeatureExtractor` fields (128 mel bins, 16 kHz, 10 ms hop), as Qwen-Omni ships them."""
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": 128,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 30,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
    }


def vision_processor_files(config: PretrainedConfig) -> dict[str, dict[str, Any]]:
    return {"preprocessor_config.json": image_processor_config(config)}


def omni_processor_files(config: PretrainedConfig) -> dict[str, dict[str, Any]]:
    return {"preprocessor_config.json": {**audio_processor_config(), **image_processor_config(config)}}
