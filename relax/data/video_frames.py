"""Video frames to Qwen vision patches without torchvision: frame sampling at a frame rate, a token budget,
and the Qwen2-VL video patch layout.

Layout (the Qwen2-VL video processor's): frames [T, C, H, W] are grouped into `grid_t = T / tp` temporal
patches, each frame split into p x p patches and merge x merge patch blocks; one row per patch,
ordered (t, h-block, w-block, h-in-block, w-in-block), each row (C, tp, p, p) flattened.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from PIL import Image

from relax.data.media import Video

logger = logging.getLogger(__name__)


def sample_frames(
    video: Video, fps: float, max_frames: int, temporal_patch: int
) -> tuple[list[Image.Image], float]:
    """Frames sampled at about `fps` (at most `max_frames`, evenly spread), padded by repeating the last
    frame to a multiple of `temporal_patch`; returns them and their effective frame rate."""
    n = len(video.frames)
    duration = n / video.fps
    count = int(min(max(1, round(duration * fps)), max_frames, n))
    idx = np.linspace(0, n - 1, count).round().astype(int)
    frames = [video.frames[i] for i in idx]
    while len(frames) % temporal_patch:
        frames.append(frames[-1])
    return frames, count / duration


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's rule: sides rounded to multiples of `factor`, area kept within [min_pixels, max_pixels]."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = (height * width / max_pixels) ** 0.5
        h = max(factor, int(height / beta // factor) * factor)
        w = max(factor, int(width / beta // factor) * factor)
    elif h * w < min_pixels:
        beta = (min_pixels / (height * width)) ** 0.5
        h = int(np.ceil(height * beta / factor)) * factor
        w = int(np.ceil(width * beta / factor)) * factor
    return h, w


def video_patches(frames: list[Image.Image], ip: Any, max_tokens: int) -> tuple[np.ndarray, list[int]]:
    """Flattened patches [grid_t * grid_h * grid_w, C * tp * p * p] and the grid [t, h, w] of a video,
    frames shrunk so that grid_t * grid_h * grid_w / merge^2 <= max_tokens (at least one token per frame
    group). `ip` is the model's image processor (patch/merge/temporal sizes, mean/std, pixel bounds)."""
    p, m, tp = ip.patch_size, ip.merge_size, ip.temporal_patch_size
    factor = p * m
    grid_t = len(frames) // tp
    size = dict(ip.size)
    per_group = max(1, max_tokens // grid_t)
    max_pixels = min(per_group * factor * factor, size.get("longest_edge") or 1 << 30)
    width, height = frames[0].size
    h, w = smart_resize(height, width, factor, factor * factor, max(max_pixels, factor * factor))
    mean = np.asarray(ip.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(ip.image_std, dtype=np.float32)[:, None, None]
    arr = np.stack(
        [
            (np.asarray(f.resize((w, h), Image.BICUBIC), dtype=np.float32).transpose(2, 0, 1) / 255.0 - mean)
            / std
            for f in frames
        ]
    )  # [T, C, h, w]
    C = arr.shape[1]
    gh, gw = h // p, w // p
    x = arr.reshape(grid_t, tp, C, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, hb, wb, hm, wm, C, tp, p, p
    return np.ascontiguousarray(x.reshape(grid_t * gh * gw, C * tp * p * p)), [grid_t, gh, gw]
