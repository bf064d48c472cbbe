"""Multimodal prompts: chat messages with `<image>`, `<video>`, `<audio>` placeholders plus their media
become prompt token ids and the model's input tensors.

`MultimodalProcessor(model_path, media_cfg).process(prompt, media)` returns a `ProcessedPrompt`:

* `prompt_ids`: the chat-templated prompt with every placeholder replaced by the model's own media tokens
  (`<|vision_start|><|image_pad|>*N<|vision_end|>`, `<|audio_start|><|audio_pad|>*N<|audio_end|>`, ...;
  the token strings come from the ids in the model's config, so a real checkpoint works the same);
* `multimodal_inputs`: tensors keyed by the model's forward kwargs (`pixel_values`, `image_grid_thw`,
  `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts` / `video_second_per_grid`,
  `input_features`, `feature_attention_mask`).

The `direct` path (the default) uses the model's image processor (`Qwen2VLImageProcessor`) and feature
extractor (`WhisperFeatureExtractor`) and counts the tokens itself, so it needs no torchvision. Videos
are sampled at `video_fps` (at most `video_max_frames` frames, padded to a multiple of the temporal patch)
and each frame is resized so the video fits `video_max_tokens`. The `full` path hands the templated text
to the model's processor class instead. `relax.data.mm_pool` runs either in worker processes.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from relax.data.config import MediaConfig
from relax.data.dataset import DataError
from relax.data.media import Video, load_audio, load_image, load_video
from relax.data.video_frames import sample_frames, video_patches

logger = logging.getLogger(__name__)

PLACEHOLDERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
_PLACEHOLDER_RE = re.compile(r"<(image|video|audio)>")


@dataclass
class ProcessedPrompt:
    prompt_ids: list[int]  # templated prompt with expanded media tokens, [P]
    multimodal_inputs: dict[str, Tensor] | None  # forward kwargs of the media; None for a text prompt


def _content_text(content: Any) -> str:
    """Message content as text; OpenAI-style parts ({"type": "image"}, {"type": "text", ...}) become
    placeholders and text."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        kind = part.get("type") if isinstance(part, dict) else None
        parts.append(PLACEHOLDERS[kind] if kind in PLACEHOLDERS else str(part.get("text", "")))
    return "".join(parts)


def audio_token_count(model_type: str, frames: int) -> int:
    """LLM tokens of an audio clip of `frames` mel frames, as the model's audio encoder emits them."""
    if model_type == "qwen3_omni_moe_thinker":
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            _get_feat_extract_output_lengths,
        )

        return int(_get_feat_extract_output_lengths(torch.tensor(frames)))
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


class MultimodalProcessor:
    def __init__(self, model_path: str, cfg: MediaConfig | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.cfg = cfg or MediaConfig()
        self.model_path = str(model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.config = AutoConfig.from_pretrained(self.model_path)
        self.model_type = self.config.model_type
        self.image_processor = _image_processor(self.model_path)
        self.feature_extractor = None
        if getattr(self.config, "audio_config", None) is not None:
            from transformers import WhisperFeatureExtractor

            self.feature_extractor = WhisperFeatureExtractor.from_pretrained(self.model_path)
        self.full = _full_processor(self.model_path) if self.cfg.processor in ("full", "auto") else None
        if self.cfg.processor == "full" and self.full is None:
            raise RuntimeError(f"data.media.processor=full but the processor of {model_path} does not load")
        self.tokens = self._media_tokens()

    def _media_tokens(self) -> dict[str, tuple[str, str, str]]:
        """kind -> (start, pad, end) token strings, from the config's token ids."""
        c, tok = self.config, self.tokenizer.convert_ids_to_tokens

        def get(name: str, default: int | None = None) -> str | None:
            v = getattr(c, name, None)
            return tok(int(v)) if v is not None else (tok(default) if default is not None else None)

        v_start = get("vision_start_token_id")
        v_end = get("vision_end_token_id", getattr(c, "vision_start_token_id", 0) + 1)
        out = {
            "image": (v_start, get("image_token_id"), v_end),
            "video": (v_start, get("video_token_id"), v_end),
        }
        if getattr(c, "audio_token_id", None) is not None:
            a_start = get("audio_start_token_id")
            out["audio"] = (
                a_start,
                get("audio_token_id"),
                get("audio_end_token_id", c.audio_start_token_id + 1),
            )
        return out

    # -- one prompt ------------------------------------------------------------------------------
    def process(
        self,
        prompt: str | list[dict[str, Any]],
        media: dict[str, list[str]],
        *,
        where: str = "prompt",
        system_prompt: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        messages = [{**m, "content": _content_text(m.get("content"))} for m in messages]
        if system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        counts = {k: 0 for k in PLACEHOLDERS}
        for m in messages:
            for kind in _PLACEHOLDER_RE.findall(m["content"]):
                counts[kind] += 1
        for kind, n in counts.items():
            have = len(media.get(kind, []))
            if n != have:
                raise DataError(
                    f"{where}: the messages hold {n} {PLACEHOLDERS[kind]} placeholder(s) but the row lists "
                    f"{have} {kind} item(s); give one {kind} per placeholder, in order"
                )
            if n and kind not in self.tokens:
                raise DataError(f"{where}: {kind} input is not supported by model type {self.model_type!r}")
        for m in messages:
            m["content"] = _PLACEHOLDER_RE.sub(lambda x: "".join(self.tokens[x.group(1)]), m["content"])
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
        if self.full is not None:
            return self._process_full(text, media, where)
        tensors, token_counts = self._tensors(media, where)
        for kind, counts_k in token_counts.items():
            text = self._expand(text, self.tokens[kind][1], counts_k)
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return ProcessedPrompt(ids, tensors or None)

    @staticmethod
    def _expand(text: str, pad: str, counts: list[int]) -> str:
        """Replace the k-th `pad` token with counts[k] copies of it."""
        pieces = text.split(pad)
        out = [pieces[0]]
        for k, piece in enumerate(pieces[1:]):
            out.append(pad * counts[k] + piece)
        return "".join(out)

    def _tensors(
        self, media: dict[str, list[str]], where: str
    ) -> tuple[dict[str, Tensor], dict[str, list[int]]]:
        tensors: dict[str, Tensor] = {}
        counts: dict[str, list[int]] = {}
        merge2 = self.image_processor.merge_size**2
        if media.get("image"):
            images = [load_image(r, f"{where}: image {j}") for j, r in enumerate(media["image"])]
            kw = {}
            if self.cfg.image_min_pixels or self.cfg.image_max_pixels:
                size = dict(self.image_processor.size)
                kw["size"] = {
                    "shortest_edge": self.cfg.image_min_pixels or size["shortest_edge"],
                    "longest_edge": self.cfg.image_max_pixels or size["longest_edge"],
                }
            out = self.image_processor(images=images, return_tensors="pt", **kw)
            tensors["pixel_values"], tensors["image_grid_thw"] = out["pixel_values"], out["image_grid_thw"]
            counts["image"] = [int(g.prod()) // merge2 for g in out["image_grid_thw"]]
        if media.get("video"):
            if self.model_type in ("qwen3_vl", "qwen3_omni_moe_thinker"):
                raise DataError(
                    f"{where}: video input is not supported yet for {self.model_type} (timestamps)"
                )
            videos = [load_video(r, f"{where}: video {j}") for j, r in enumerate(media["video"])]
            self._add_videos(videos, tensors, counts)
        if media.get("audio"):
            self._add_audio(media["audio"], where, tensors, counts)
        return tensors, counts

    def _add_videos(
        self, videos: list[Video], tensors: dict[str, Tensor], counts: dict[str, list[int]]
    ) -> None:
        ip, cfg = self.image_processor, self.cfg
        patches, grids, seconds = [], [], []
        for video in videos:
            frames, fps = sample_frames(video, cfg.video_fps, cfg.video_max_frames, ip.temporal_patch_size)
            flat, grid = video_patches(frames, ip, cfg.video_max_tokens)
            patches.append(flat)
            grids.append(grid)
            seconds.append(ip.temporal_patch_size / fps)
        tensors["pixel_values_videos"] = torch.from_numpy(np.concatenate(patches))
        tensors["video_grid_thw"] = torch.tensor(grids, dtype=torch.long)
        key = "video_second_per_grid" if "omni" in self.model_type else "second_per_grid_ts"
        if self.model_type != "qwen2_vl":
            tensors[key] = torch.tensor(seconds, dtype=torch.float32)
        counts["video"] = [int(np.prod(g)) // ip.merge_size**2 for g in grids]

    def _add_audio(
        self, refs: list[str], where: str, tensors: dict[str, Tensor], counts: dict[str, list[int]]
    ) -> None:
        fe = self.feature_extractor
        rate = fe.sampling_rate
        clips = [load_audio(r, rate, f"{where}: audio {j}") for j, r in enumerate(refs)]
        for j, clip in enumerate(clips):
            if len(clip) > self.cfg.audio_max_seconds * rate:
                raise DataError(
                    f"{where}: audio {j} lasts {len(clip) / rate:.1f} s, more than data.media.audio_max_seconds="
                    f"{self.cfg.audio_max_seconds}; trim it"
                )
            if len(clip) < fe.hop_length * 4:
                raise DataError(f"{where}: audio {j} is too short ({len(clip)} samples); give at least 40 ms")
        out = fe(
            clips, sampling_rate=rate, return_attention_mask=True, padding="longest", return_tensors="pt"
        )
        tensors["input_features"] = out["input_features"]  # [N, mel, F]
        tensors["feature_attention_mask"] = out["attention_mask"].long()  # [N, F]
        counts["audio"] = [audio_token_count(self.model_type, int(n)) for n in out["attention_mask"].sum(-1)]

    def _process_full(self, text: str, media: dict[str, list[str]], where: str) -> ProcessedPrompt:
        """The model's own processor class (needs torchvision for the Qwen video processors)."""
        kw: dict[str, Any] = {}
        if media.get("image"):
            kw["images"] = [load_image(r, f"{where}: image {j}") for j, r in enumerate(media["image"])]
        if media.get("video"):
            kw["videos"] = [
                [np.asarray(f) for f in load_video(r, f"{where}: video {j}").frames]
                for j, r in enumerate(media["video"])
            ]
        if media.get("audio"):
            rate = self.feature_extractor.sampling_rate
            kw["audio"] = [load_audio(r, rate, f"{where}: audio {j}") for j, r in enumerate(media["audio"])]
        out = self.full(text=[text], return_tensors="pt", **kw)
        ids = out.pop("input_ids")[0].tolist()
        skip = {"attention_mask", "mm_token_type_ids"}
        return ProcessedPrompt(
            ids, {k: v for k, v in out.items() if k not in skip and isinstance(v, Tensor)} or None
        )


def _image_processor(path: str) -> Any:
    """The folder's Qwen2-VL image processor; the PIL backend when torchvision is missing (same output)."""
    try:
        import torchvision  # noqa: F401
        from transformers import Qwen2VLImageProcessor as cls
    except ImportError:
        from transformers import Qwen2VLImageProcessorPil as cls
    return cls.from_pretrained(path)


def _full_processor(path: str) -> Any | None:
    try:
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure means: use the direct path
        logger.info("the processor class of %s does not load (%s); using the direct path", path, e)
        return None
