"""What the engine and the trainer need to know about a multimodal Qwen model, in one place.

* `load_causal_lm(path)`: the model class of a folder: `AutoModelForCausalLM` for text models, the
  image-text-to-text class for Qwen2-VL / Qwen2.5-VL / Qwen3-VL, the thinker class for the Omni thinkers.
* `rope_positions(model, input_ids, attention_mask, mm)`: the model's own multimodal rotary positions
  (mrope, [3, B, L]) and each row's rope delta (position of the next token minus its cache column), from
  the model's `get_rope_index`.
* `model_inputs(model, input_ids, attention_mask, mm_rows)`: the forward kwargs of a padded batch whose
  rows carry `multimodal_inputs` (or None): the rows' tensors concatenated in row order plus the mrope
  `position_ids`. The engine's prefill and the trainer's log-probs both call it, so both run the very
  same inputs through the very same code.

A sample's `multimodal_inputs` is a dict of tensors keyed by the model's forward kwarg names
(`pixel_values`, `image_grid_thw`, `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts` or
`video_second_per_grid`, `input_features`, `feature_attention_mask`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

VL_TYPES = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl"}
OMNI_TYPES = {"qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"}
MULTIMODAL_TYPES = VL_TYPES | OMNI_TYPES
# Per-item tensors padded along their last axes when rows are concatenated (audio frames differ).
_PADDED = {"input_features", "feature_attention_mask"}


_MEDIA_TOKEN_FIELDS = (
    "image_token_id",
    "video_token_id",
    "audio_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
)
BANNED_LOGIT = -1e30  # logit given to media tokens: exp() underflows to 0, and 0 * BANNED_LOGIT = 0


def banned_token_ids(model: nn.Module) -> list[int]:
    """Media tokens a multimodal model must never generate: a generated `<|image_pad|>` or
    `<|audio_start|>` in a response would be read as a media placeholder when the trainer re-runs the
    sequence. The engine never samples them and both engine and trainer compute log-probs over the
    remaining vocabulary (their logits set to `BANNED_LOGIT`), so the two still agree."""
    if not is_multimodal(model):
        return []
    cfg = model.config
    return sorted({int(v) for f in _MEDIA_TOKEN_FIELDS if (v := getattr(cfg, f, None)) is not None})


def mask_media_logits(logits: Tensor, banned: list[int] | Tensor) -> Tensor:
    """`logits` [..., V] with the banned media tokens set to `BANNED_LOGIT` (a new tensor; autograd-safe).
    `banned` as a tensor on the logits' device copies nothing from the host (a captured CUDA graph cannot)."""
    if len(banned) == 0:
        return logits
    if not isinstance(banned, Tensor):
        banned = torch.tensor(banned, device=logits.device)
    return logits.index_fill(-1, banned, BANNED_LOGIT)


def model_type_of(path: str | Path) -> str:
    from transformers import AutoConfig

    return str(AutoConfig.from_pretrained(str(path)).model_type)


def load_causal_lm(path: str | Path, **kwargs: Any) -> nn.Module:
    """The folder's generative model: a text causal LM, a VL model or an Omni thinker (a VL model's window
    attention batched: `relax.models.vision_attention`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from relax.models.vision_attention import group_window_attention

    model_type = model_type_of(path)
    if model_type in VL_TYPES or model_type in OMNI_TYPES:
        model = AutoModelForImageTextToText.from_pretrained(str(path), **kwargs)
        group_window_attention(model)  # the vision tower's windows in a few calls, not one each
        return model
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)


def is_multimodal(model: nn.Module) -> bool:
    return getattr(model.config, "model_type", None) in MULTIMODAL_TYPES


def inner_model(model: nn.Module) -> nn.Module:
    """The body that runs the encoders and the text decoder (`Qwen2_5_VLModel`, `...ThinkerModel`)."""
    return model.model


def concat_inputs(
    rows: list[dict[str, Tensor] | None], device: torch.device | None = None
) -> dict[str, Tensor]:
    """Concatenate the rows' multimodal tensors along the item axis, in row order (the order the
    model consumes images/videos/audios in). Audio features of different lengths are zero-padded."""
    present = [r for r in rows if r]
    keys = sorted({k for r in present for k in r})
    out: dict[str, Tensor] = {}
    for key in keys:
        parts = [r[key] for r in present if key in r]
        if key in _PADDED and len({p.shape[1:] for p in parts}) > 1:
            size = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
            padded = []
            for p in parts:
                pad: list[int] = []
                for d in reversed(range(1, p.dim())):
                    pad += [0, size[d - 1] - p.shape[d]]
                padded.append(torch.nn.functional.pad(p, pad))
            parts = padded
        t = torch.cat(parts, dim=0)
        out[key] = t.to(device) if device is not None else t
    return out


def _token_types(config: Any, input_ids: Tensor) -> Tensor:
    """`mm_token_type_ids`: 0 text, 1 image, 2 video (what the VL processors return)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def rope_positions(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, mm: dict[str, Tensor]
) -> tuple[Tensor, Tensor]:
    """mrope position ids [3, B, L] and rope deltas [B] for a padded batch (`attention_mask` 1 on real
    tokens, either side padded); `mm` is the batch's concatenated multimodal inputs."""
    inner = inner_model(model)
    cfg = model.config
    model_type = cfg.model_type
    if model_type in VL_TYPES:
        kwargs: dict[str, Any] = {
            "image_grid_thw": mm.get("image_grid_thw"),
            "video_grid_thw": mm.get("video_grid_thw"),
            "attention_mask": attention_mask,
        }
        if "second_per_grid_ts" in mm:
            kwargs["second_per_grid_ts"] = mm["second_per_grid_ts"]
        types = _token_types(cfg, input_ids)
        pos, delta = inner.get_rope_index(input_ids, types, **kwargs)
        if mm.get("video_grid_thw") is not None:
            pos, delta = _text_after_media_at_max_plus_one(pos, types, attention_mask)
    elif model_type in OMNI_TYPES:
        fam = mm.get("feature_attention_mask")
        pos, delta = inner.get_rope_index(
            input_ids,
            mm.get("image_grid_thw"),
            mm.get("video_grid_thw"),
            attention_mask,
            False,
            fam.sum(-1) if fam is not None else None,
            mm.get("video_second_per_grid"),
        )
    else:
        raise ValueError(
            f"model type {model_type!r} has no multimodal positions; known: {sorted(MULTIMODAL_TYPES)}"
        )
    return pos.long().to(input_ids.device), delta.reshape(-1).long().to(input_ids.device)


def _text_after_media_at_max_plus_one(
    pos: Tensor, types: Tensor, attention_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Qwen2-VL / Qwen2.5-VL positions with the text after a video starting at the largest position so
    far plus one, as the models were trained (their `get_rope_index` docstring: "the text start
    position_ids as the max vision position_ids plus 1"), and the rope deltas of those positions.

    `transformers` 5's `get_rope_index` starts it after the video's *spatial* extent only, while its
    decode continues from the largest position plus one (the delta). Where a video's time positions run
    past its height and width (several temporal patches, `tokens_per_second` > 1) the two disagree: the
    trainer, which runs prompt and response through `get_rope_index`, would place the response's tokens
    elsewhere than the engine that generated them. With every text run starting at max + 1, the prompt's
    last token holds the largest position and both agree. Images (one temporal patch) are unchanged."""
    pos = pos.clone()
    for b in range(pos.shape[1]):
        real = attention_mask[b].bool()
        row, kinds = pos[:, b, real], types[b, real]
        starts = torch.nonzero(torch.diff(kinds, prepend=kinds[:1] - 1)).flatten().tolist()
        shift, top = 0, None
        for i, s in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else row.shape[1]
            run = row[:, s:end]
            if kinds[s] == 0 and top is not None:  # text after media
                shift = int(top) + 1 - int(run[0, 0])
            run += shift
            top = run.max() if top is None else torch.maximum(top, run.max())
        pos[:, b, real] = row
    n_real = attention_mask.sum(-1)
    masked = pos.masked_fill(~attention_mask.bool().unsqueeze(0), -1)
    delta = masked.amax(dim=(0, 2)) + 1 - n_real
    return pos, delta


# the small per-item tensors the mrope positions are computed from (pixels and audio features are not)
_POSITION_KEYS = {
    "image_grid_thw",
    "video_grid_thw",
    "second_per_grid_ts",
    "video_second_per_grid",
    "feature_attention_mask",
}


def model_inputs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    mm_rows: list[dict[str, Tensor] | None],
    dedupe: bool = False,
) -> Any:
    """Forward kwargs (besides input_ids and the attention mask) for a padded batch of a multimodal model:
    the rows' media tensors and the mrope `position_ids` [3, B, L].

    `dedupe` (the trainer): returns (kwargs, plan) where the media tensors are those of one row per group
    of rows with equal media, and `plan` (a `media_dedup.MediaPlan`, or None when nothing repeats) is what
    `media_dedup.expanding_media` needs around the model call to hand every row its encodings."""
    device = input_ids.device
    plan = None
    if dedupe:
        from relax.models.media_dedup import plan_media

        plan = plan_media(mm_rows, input_ids, getattr(model.config, "audio_token_id", None))
    if plan is None:
        mm = concat_inputs(mm_rows, device)
        pos, _ = rope_positions(model, input_ids, attention_mask, mm)
    else:  # positions from every row's grids; the encoders' inputs from the kept rows only
        small = [{k: v for k, v in r.items() if k in _POSITION_KEYS} if r else None for r in mm_rows]
        pos, _ = rope_positions(model, input_ids, attention_mask, concat_inputs(small, device))
        mm = concat_inputs(plan.kept_rows, device)
    for key in ("pixel_values", "pixel_values_videos", "input_features"):
        if key in mm:
            mm[key] = mm[key].to(model.dtype)
    kwargs = {**mm, "position_ids": pos}
    return (kwargs, plan) if dedupe else kwargs
