"""Reading the media a data row points at: images, videos and audio clips.

A media reference is a string:

* a file path (relative paths are resolved against the data file's folder, then the working folder),
* a `file://` URL of a local file,
* a data URI `data:<mime>;base64,<payload>`, or a bare base64 payload (SGLang accepts both).

Images: any format Pillow reads. Audio: WAV (integer PCM of 8/16/24/32 bits, or 32/64-bit float) or `.npy` (float samples at
`DEFAULT_NPY_RATE` Hz unless the name ends in `.<rate>hz.npy`), mixed down to mono and resampled to the
feature extractor's rate. Videos: an animated GIF/WebP (frame rate from the frame durations), a `.npy`
array [T, H, W, 3] (uint8; `DEFAULT_VIDEO_FPS`), or a folder of frame images (sorted by name).

Every failure raises `MediaError` (a `DataError`) naming the row, the kind, the item and what to fix.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import re
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from relax.data.dataset import DataError

logger = logging.getLogger(__name__)

MEDIA_KINDS = ("image", "video", "audio")
DEFAULT_NPY_RATE = 16000  # Hz of a .npy audio clip without a `.<rate>hz.npy` suffix
DEFAULT_VIDEO_FPS = 2.0  # frame rate of a .npy video or a folder of frames
_DATA_URI = re.compile(r"^data:[^;,]*(;[^,]*)?;base64,", re.IGNORECASE)


class MediaError(DataError):
    """A media item of a row is missing or unreadable."""


@dataclass
class Video:
    frames: list[Image.Image]  # RGB frames in time order
    fps: float  # frames per second of `frames`


def is_inline(ref: str) -> bool:
    """Whether `ref` carries the media itself (a data URI or a bare base64 payload), not a location."""
    if _DATA_URI.match(ref):
        return True
    # bare base64: only the base64 alphabet (a file name has a dot), a multiple of 4 characters
    head = "".join(ref[:4096].split())
    if len(head) < 32 or re.fullmatch(r"[A-Za-z0-9+/]+={0,2}", head) is None:
        return False
    return len(ref) > 4096 or len(head) % 4 == 0


def resolve_ref(ref: str, base_dir: Path | None, where: str, kind: str) -> str:
    """A path reference made absolute (checked to exist); inline references are returned unchanged."""
    if not isinstance(ref, str) or not ref:
        raise MediaError(f"{where}: {kind} reference must be a non-empty string, got {ref!r}")
    if is_inline(ref):
        return ref
    path = Path(ref[len("file://") :] if ref.startswith("file://") else ref)
    candidates = [path] if path.is_absolute() or base_dir is None else [base_dir / path, path]
    for c in candidates:
        if c.exists():
            return str(c.resolve())
    tried = ", ".join(str(c) for c in candidates)
    raise MediaError(f"{where}: {kind} file {ref!r} not found (looked at {tried}); fix the path in the row")


def _bytes(ref: str) -> bytes | None:
    """The decoded payload of an inline reference, None for a path."""
    if not is_inline(ref):
        return None
    payload = ref.split(",", 1)[1] if _DATA_URI.match(ref) else ref
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"invalid base64 data ({e})") from None


def _source(ref: str) -> str:
    return "inline base64 data" if is_inline(ref) else repr(ref)


def load_image(ref: str, where: str = "") -> Image.Image:
    try:
        data = _bytes(ref)
        img = Image.open(io.BytesIO(data) if data is not None else ref)
        img.load()
        return img.convert("RGB")
    except Exception as e:  # noqa: BLE001 - Pillow raises many types
        raise MediaError(f"{where}: cannot read image {_source(ref)} ({type(e).__name__}: {e})") from e


def load_video(ref: str, where: str = "") -> Video:
    try:
        data = _bytes(ref)
        if data is None and Path(ref).is_dir():
            files = sorted(
                p for p in Path(ref).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp")
            )
            if not files:
                raise ValueError("the folder holds no .png/.jpg/.webp frames")
            return Video([Image.open(f).convert("RGB") for f in files], DEFAULT_VIDEO_FPS)
        if data is None and ref.endswith(".npy"):
            arr = np.load(ref)
            if arr.ndim != 4 or arr.shape[-1] != 3:
                raise ValueError(f"a .npy video must be [T, H, W, 3], got shape {arr.shape}")
            return Video([Image.fromarray(f.astype(np.uint8)) for f in arr], DEFAULT_VIDEO_FPS)
        img = Image.open(io.BytesIO(data) if data is not None else ref)
        frames, durations = [], []
        for i in range(getattr(img, "n_frames", 1)):
            img.seek(i)
            frames.append(img.convert("RGB"))
            durations.append(float(img.info.get("duration", 500)) or 500.0)
        return Video(frames, 1000.0 / (sum(durations) / len(durations)))
    except Exception as e:  # noqa: BLE001
        raise MediaError(f"{where}: cannot read video {_source(ref)} ({type(e).__name__}: {e})") from e


def _read_wav(src: str | io.BytesIO) -> tuple[np.ndarray, int]:
    """Mono float32 samples and the rate of a RIFF/WAVE file: integer PCM of 8, 16, 24 or 32 bits or
    IEEE float of 32 or 64 bits, plain or WAVE_FORMAT_EXTENSIBLE (the stdlib `wave` reads PCM only)."""
    buf = src.getvalue() if isinstance(src, io.BytesIO) else Path(src).read_bytes()
    if buf[:4] != b"RIFF" or buf[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    fmt, raw, pos = None, None, 12
    while pos + 8 <= len(buf) and (fmt is None or raw is None):
        cid, size = buf[pos : pos + 4], int.from_bytes(buf[pos + 4 : pos + 8], "little")
        body = buf[pos + 8 : pos + 8 + size]
        if cid == b"fmt ":
            fmt = body
        elif cid == b"data":
            raw = body
        pos += 8 + size + (size & 1)  # chunks are word-aligned
    if fmt is None or raw is None:
        raise ValueError("WAV file without a fmt or data chunk")
    tag, channels, rate = (int.from_bytes(fmt[a:b], "little") for a, b in ((0, 2), (2, 4), (4, 8)))
    bits = int.from_bytes(fmt[14:16], "little")
    if tag == 0xFFFE and len(fmt) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the sub-format GUID starts with the tag
        tag = int.from_bytes(fmt[24:26], "little")
    width = bits // 8
    raw = raw[: len(raw) - len(raw) % (width * channels)] if width and channels else raw
    if tag == 3 and bits in (32, 64):
        x = np.frombuffer(raw, "<f4" if bits == 32 else "<f8").astype(np.float32)
    elif tag == 1 and bits == 8:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == 1 and bits == 16:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif tag == 1 and bits == 24:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 8388608.0
    elif tag == 1 and bits == 32:
        x = np.frombuffer(raw, "<i4").astype(np.float32) / 2147483648.0
    else:
        raise ValueError(
            f"unsupported WAV encoding (format tag {tag}, {bits} bits); use integer PCM or 32/64-bit float"
        )
    return x.reshape(-1, channels).mean(axis=1), rate


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Linear-interpolation resampling (enough for speech features; no extra dependency)."""
    if rate == target or len(x) == 0:
        return x.astype(np.float32)
    n = max(1, round(len(x) * target / rate))
    t = np.arange(n, dtype=np.float64) * (rate / target)
    return np.interp(t, np.arange(len(x)), x).astype(np.float32)


def load_audio(ref: str, sample_rate: int, where: str = "") -> np.ndarray:
    """Mono float32 samples at `sample_rate` Hz."""
    try:
        data = _bytes(ref)
        if data is None and ref.endswith(".npy"):
            m = re.search(r"\.(\d+)hz\.npy$", ref)
            x, rate = np.load(ref).astype(np.float32), int(m.group(1)) if m else DEFAULT_NPY_RATE
            x = x.mean(axis=-1) if x.ndim == 2 else x
        else:
            x, rate = _read_wav(io.BytesIO(data) if data is not None else ref)
        return resample(x, rate, sample_rate)
    except Exception as e:  # noqa: BLE001
        raise MediaError(f"{where}: cannot read audio {_source(ref)} ({type(e).__name__}: {e})") from e


def write_wav(
    path: str | Path | io.BytesIO, samples: np.ndarray, sample_rate: int
) -> str | Path | io.BytesIO:
    """Write mono float samples in [-1, 1] as 16-bit PCM WAV (to a path or a binary buffer)."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(path if isinstance(path, io.BytesIO) else str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return path
