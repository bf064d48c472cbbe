"""Synthetic multimodal toy tasks that a tiny model learns on CPU, with their data generators.

* **colors** (images, a Qwen-VL model): a noisy square of one of four colours; the prompt lists the
  colours with a digit each and the label is the digit (reward `first_number`, chance 0.25).
* **tones** (audio, an Omni thinker): a half-second sine tone, either low (200-400 Hz) or high
  (1.6-3.2 kHz); "is the tone low (1) or high (2)?" (reward `first_number`, chance 0.5).

Media go into `<out stem>_media/` beside the data file and rows reference them by relative path (or
inline as base64 data URIs with `inline=True`). Rows look like
`{"messages": [{"role": "user", "content": "<image> Which colour ..."}], "images": ["colors_media/3.png"],
"label": "2", "metadata": {"task": "colors"}}`.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from relax.data.media import write_wav

logger = logging.getLogger(__name__)

COLORS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (40, 70, 220), "yellow": (230, 215, 40)}
COLOR_PROMPT = (
    "<image>\nWhich colour is this image? 0 = red, 1 = green, 2 = blue, 3 = yellow. Answer with the digit."
)
TONE_PROMPT = "<audio>\nIs this tone low or high? Answer 1 for low, 2 for high."
SAMPLE_RATE = 16000


def _media_dir(out: Path) -> Path:
    d = out.parent / f"{out.stem}_media"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _inline(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def color_image(color: str, rng: np.random.Generator, size: int = 56) -> Image.Image:
    """A `size` x `size` square of `color` with pixel noise."""
    base = np.array(COLORS[color], dtype=np.float32)
    pixels = base + rng.normal(0, 18, size=(size, size, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def tone(freq_hz: float, seconds: float = 0.5, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    return (0.5 * np.sin(2 * np.pi * freq_hz * t)).astype(np.float32)


def _write_rows(out: Path, rows: list[dict[str, Any]]) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return out


def generate_colors(
    out_path: str | Path, n: int = 512, seed: int = 0, size: int = 56, inline: bool = False
) -> Path:
    """Write `n` colour rows (.jsonl) and their PNG images; return the data file."""
    out = Path(out_path)
    rng, prng = np.random.default_rng(seed), random.Random(seed)
    names = list(COLORS)
    media = None if inline else _media_dir(out)
    rows = []
    for i in range(n):
        k = prng.randrange(len(names))
        img = color_image(names[k], rng, size)
        if media is None:
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            ref = _inline(buf.getvalue(), "image/png")
        else:
            img.save(media / f"{i}.png")
            ref = f"{media.name}/{i}.png"
        rows.append(
            {
                "messages": [{"role": "user", "content": COLOR_PROMPT}],
                "images": [ref],
                "label": str(k),
                "metadata": {"task": "colors", "color": names[k]},
            }
        )
    logger.info("wrote %d colour rows to %s", n, out)
    return _write_rows(out, rows)


def generate_tones(
    out_path: str | Path, n: int = 512, seed: int = 0, seconds: float = 0.5, inline: bool = False
) -> Path:
    """Write `n` tone rows (.jsonl) and their WAV clips; return the data file."""
    out = Path(out_path)
    prng = random.Random(seed)
    media = None if inline else _media_dir(out)
    rows = []
    for i in range(n):
        high = prng.random() < 0.5
        freq = prng.uniform(1600, 3200) if high else prng.uniform(200, 400)
        samples = tone(freq, seconds)
        if media is None:
            buf = io.BytesIO()
            write_wav(buf, samples, SAMPLE_RATE)
            ref = _inline(buf.getvalue(), "audio/wav")
        else:
            write_wav(media / f"{i}.wav", samples, SAMPLE_RATE)
            ref = f"{media.name}/{i}.wav"
        rows.append(
            {
                "messages": [{"role": "user", "content": TONE_PROMPT}],
                "audios": [ref],
                "label": "2" if high else "1",
                "metadata": {"task": "tones", "freq_hz": round(freq, 1)},
            }
        )
    logger.info("wrote %d tone rows to %s", n, out)
    return _write_rows(out, rows)
