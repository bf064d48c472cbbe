"""Each distinct image, video and audio of a micro-batch through the model's encoders once.

GRPO samples every prompt n times, and each sample carries its prompt's media, so a micro-batch of
training rows holds each image n times. The encoders (a 32-block vision tower for Qwen2.5-VL-3B) would
run n times on the same pixels. Instead:

1. `plan_media` groups the rows whose media are equal (same keys, shapes and values; compared exactly),
   keeps the first row of each group, and records, for every media item of every row in row order,
   which item of the kept rows it repeats;
2. the model is called with the kept rows' tensors only (so the encoders see each item once) and the
   mrope positions of all rows, which `multimodal_model.model_inputs` computes from the full grids;
3. while that call runs, `expanding_media` wraps the model's `get_image_features`,
   `get_video_features` and `get_audio_features` so that their per-item outputs come back repeated in
   the order of all rows, which is what the model scatters into the placeholder tokens.

The gradient of a repeated item reaches the encoder once per repetition and is summed by autograd, so
the result and its gradient equal those of encoding every row's media. Rows carrying more than one
audio clip are not deduplicated (their clips' output lengths are not known per clip here).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

# media kind -> the per-row key whose first axis counts the row's items of that kind
ITEM_KEYS = {"image": "image_grid_thw", "video": "video_grid_thw", "audio": "input_features"}
GETTERS = {"image": "get_image_features", "video": "get_video_features", "audio": "get_audio_features"}


@dataclass
class MediaPlan:
    """How a micro-batch's media reach the encoders: the kept rows, and the repeat order of the items."""

    kept_rows: list[dict[str, Tensor]]  # the media of one row per group of equal rows, first-seen order
    items: dict[str, list[int]]  # kind -> per item of every row (row order), its index among kept items
    audio_lens: list[int]  # output length of each kept audio clip (its placeholder tokens)

    @property
    def repeats(self) -> bool:
        return any(len(v) > len(set(v)) for v in self.items.values())


def _fingerprint(row: dict[str, Tensor]) -> tuple:
    """Cheap key of a row's media (keys, shapes, dtypes and two sums); equal rows share it."""
    parts = []
    for k in sorted(row):
        t = row[k]
        flat = t.reshape(-1)
        sums = (float(flat.double().sum()), float(flat[:: max(1, flat.numel() // 4096)].double().sum()))
        parts.append((k, tuple(t.shape), str(t.dtype), sums))
    return tuple(parts)


def _equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def _count(row: dict[str, Tensor], kind: str) -> int:
    t = row.get(ITEM_KEYS[kind])
    return 0 if t is None else int(t.shape[0])


def plan_media(
    rows: list[dict[str, Tensor] | None], input_ids: Tensor | None = None, audio_token_id: int | None = None
) -> MediaPlan | None:
    """The plan of a micro-batch's media rows (None entries are text rows), or None when no row repeats
    another's media (the model then takes every row's tensors as they are). `input_ids` [B, L] and the
    model's `audio_token_id` give each kept audio clip's output length; without them audio is not
    deduplicated."""
    media = [r for r in rows if r]
    kept: list[dict[str, Tensor]] = []
    by_key: dict[tuple, list[int]] = {}
    rep_of: list[int] = []
    for row in media:
        key = _fingerprint(row)
        match = next((j for j in by_key.get(key, []) if _equal(kept[j], row)), None)
        if match is None:
            match = len(kept)
            kept.append(row)
            by_key.setdefault(key, []).append(match)
        rep_of.append(match)
    if len(kept) == len(media):
        return None
    audio_lens: list[int] = []
    if any(_count(r, "audio") for r in kept):
        if input_ids is None or audio_token_id is None or any(_count(r, "audio") > 1 for r in media):
            return None
        media_rows = [b for b, r in enumerate(rows) if r]
        first_row = {rep: media_rows[i] for i, rep in reversed(list(enumerate(rep_of)))}
        audio_lens = [
            int((input_ids[first_row[j]] == audio_token_id).sum())
            for j, r in enumerate(kept)
            if _count(r, "audio")
        ]
    items: dict[str, list[int]] = {}
    for kind in ITEM_KEYS:
        counts = [_count(r, kind) for r in kept]
        if not any(counts):
            continue
        offsets = [sum(counts[:j]) for j in range(len(kept))]
        items[kind] = [offsets[rep] + i for rep in rep_of for i in range(counts[rep])]
    return MediaPlan(kept, items, audio_lens)


def _encoder_owner(model: nn.Module) -> nn.Module:
    """The module whose forward calls the media getters: the VL body (`model.model`), or the Omni
    thinker itself (its `model` is the text decoder)."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "get_image_features"):
        return inner
    return model


def _repeat_split(parts: list[Tensor] | tuple[Tensor, ...], order: list[int]) -> tuple[Tensor, ...]:
    return tuple(parts[j] for j in order)


def _repeat_concat(x: Tensor, sizes: list[int], order: list[int]) -> Tensor:
    parts = torch.split(x, sizes)
    return torch.cat([parts[j] for j in order])


@contextlib.contextmanager
def expanding_media(model: nn.Module, plan: MediaPlan | None) -> Iterator[None]:
    """While the body runs, its media getters encode the kept items once and hand back every row's."""
    if plan is None:
        yield
        return
    owner = _encoder_owner(model)
    active = {"depth": 0}  # a getter that calls another (Qwen3-VL's video -> image) expands only once
    patched: list[str] = []

    def wrap(kind: str, original: Any) -> Any:
        order = plan.items.get(kind)

        def getter(*args: Any, **kwargs: Any) -> Any:
            if active["depth"] or order is None:
                return original(*args, **kwargs)
            active["depth"] += 1
            try:
                out = original(*args, **kwargs)
            finally:
                active["depth"] -= 1
            return _expand(out, kind, order, plan.audio_lens)

        return getter

    try:
        for kind, name in GETTERS.items():
            if kind in plan.items and hasattr(owner, name):
                setattr(owner, name, wrap(kind, getattr(owner, name)))
                patched.append(name)
        yield
    finally:
        for name in patched:
            delattr(owner, name)  # the instance attribute hid the class's method


def _expand(out: Any, kind: str, order: list[int], audio_lens: list[int]) -> Any:
    """A getter's output with its per-item results repeated in `order`."""
    if kind == "audio":
        out.last_hidden_state = _repeat_concat(out.last_hidden_state, audio_lens, order)
        return out
    per_item = out.pooler_output
    if isinstance(per_item, Tensor):
        raise TypeError(
            f"{kind} features came back as one tensor, not one per item: this transformers version is not "
            "supported by the media de-duplication (relax/models/media_dedup.py)"
        )
    sizes = [int(e.shape[0]) for e in per_item]
    out.pooler_output = _repeat_split(per_item, order)
    # Qwen3-VL: per layer, the items concatenated (transformers 5.17) or one tensor per item (later)
    deepstack = getattr(out, "deepstack_features", None)
    if deepstack is not None:
        out.deepstack_features = [
            _repeat_concat(x, sizes, order) if isinstance(x, Tensor) else _repeat_split(x, order)
            for x in deepstack
        ]
    return out
