"""Multimodal rows: media loading (paths, file:// URLs, base64), errors that name the row and the file,
placeholder expansion, video sampling under a token budget, the worker pool and the wire codec."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from relax.data.config import MediaConfig
from relax.data.dataset import DataError, load_prompts
from relax.data.media import MediaError, load_audio, load_image, load_video, resample, write_wav
from relax.data.mm_codec import decode_inputs, encode_inputs
from relax.data.multimodal import MultimodalProcessor
from relax.data.toy_media import generate_colors, generate_tones
from relax.models.tiny import write_tiny_model

KEYS = MediaConfig().keys()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / "vl", family="qwen2_5_vl")


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / "omni", family="qwen2_5_omni")


@pytest.fixture()
def media(tmp_path):
    img = tmp_path / "img.png"
    Image.fromarray(np.full((56, 84, 3), 200, np.uint8)).save(img)
    wav = tmp_path / "tone.wav"
    write_wav(wav, np.sin(np.arange(8000) / 8000 * 2 * np.pi * 300), 8000)  # 1 s at 8 kHz
    gif = tmp_path / "clip.gif"
    frames = [Image.fromarray(np.full((64, 64, 3), 30 * i, np.uint8)) for i in range(8)]
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=250, loop=0)  # 4 fps, 2 s
    return {"image": img, "audio": wav, "video": gif}


def test_image_sources_agree(media):
    raw = media["image"].read_bytes()
    uri = "data:image/png;base64," + base64.b64encode(raw).decode()
    bare = base64.b64encode(raw).decode()
    arrays = [np.asarray(load_image(r)) for r in (str(media["image"]), uri, bare)]
    assert arrays[0].shape == (56, 84, 3)
    assert all((a == arrays[0]).all() for a in arrays)


def test_audio_resampled_to_target_rate(media):
    x = load_audio(str(media["audio"]), 16000)
    assert x.dtype == np.float32 and abs(len(x) - 16000) <= 1  # 1 s at 16 kHz
    assert len(resample(np.ones(100, np.float32), 100, 50)) == 50


def _wav_bytes(tag: int, bits: int, data: bytes, channels: int = 1, rate: int = 8000) -> bytes:
    """A RIFF/WAVE file by hand (the stdlib writes integer PCM only)."""
    extensible = tag == 0xFFFE
    fmt = (
        (0xFFFE if extensible else tag).to_bytes(2, "little")
        + channels.to_bytes(2, "little")
        + rate.to_bytes(4, "little")
        + (rate * channels * bits // 8).to_bytes(4, "little")
        + (channels * bits // 8).to_bytes(2, "little")
        + bits.to_bytes(2, "little")
    )
    if extensible:  # cbSize, valid bits, channel mask, sub-format GUID (IEEE float)
        fmt += (22).to_bytes(2, "little") + bits.to_bytes(2, "little") + (4).to_bytes(4, "little")
        fmt += (3).to_bytes(2, "little") + bytes(14)
    chunks = b"fmt " + len(fmt).to_bytes(4, "little") + fmt + b"data" + len(data).to_bytes(4, "little") + data
    return b"RIFF" + (4 + len(chunks)).to_bytes(4, "little") + b"WAVE" + chunks


def test_wav_encodings_read_the_same_samples(tmp_path):
    """Integer PCM (8/16/24/32 bits), 32/64-bit float, WAVE_FORMAT_EXTENSIBLE and stereo all decode to
    the same mono samples; an unknown encoding names itself and the fix."""
    want = np.array([0.0, 0.5, -0.5, 0.25], np.float32)
    pcm24 = b"".join(int(v * 8388608).to_bytes(3, "little", signed=True) for v in want)
    stereo = np.repeat(want[:, None], 2, axis=1).astype("<f4").tobytes()
    files = {
        "u8": _wav_bytes(1, 8, (want * 128 + 128).astype(np.uint8).tobytes()),
        "i16": _wav_bytes(1, 16, (want * 32768).astype("<i2").tobytes()),
        "i24": _wav_bytes(1, 24, pcm24),
        "i32": _wav_bytes(1, 32, (want.astype(np.float64) * 2**31).astype("<i4").tobytes()),
        "f32": _wav_bytes(3, 32, want.astype("<f4").tobytes()),
        "f64": _wav_bytes(3, 64, want.astype("<f8").tobytes()),
        "ext": _wav_bytes(0xFFFE, 32, want.astype("<f4").tobytes()),
        "stereo": _wav_bytes(3, 32, stereo, channels=2),
    }
    for name, raw in files.items():
        (tmp_path / f"{name}.wav").write_bytes(raw)
        got = load_audio(str(tmp_path / f"{name}.wav"), 8000)
        np.testing.assert_allclose(got, want, atol=1e-2, err_msg=name)
    (tmp_path / "alaw.wav").write_bytes(_wav_bytes(6, 8, bytes(4)))
    with pytest.raises(MediaError, match="format tag 6.*use integer PCM or 32/64-bit float"):
        load_audio(str(tmp_path / "alaw.wav"), 8000)


def test_video_frame_rate_from_gif(media):
    v = load_video(str(media["video"]))
    assert len(v.frames) == 8 and v.fps == pytest.approx(4.0)


def test_rows_resolve_paths_and_name_missing_files(tmp_path, media):
    rows = [
        {"messages": [{"role": "user", "content": "<image> hi"}], "images": ["img.png"]},
        {"messages": [{"role": "user", "content": "<audio>"}], "audios": [f"file://{media['audio']}"]},
    ]
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    loaded = load_prompts(f, media_keys=KEYS)
    assert loaded[0].media == {"image": [str(media["image"].resolve())]}
    assert loaded[1].media["audio"] == [str(media["audio"].resolve())]
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "<image>"}], "images": ["nope.png"]}))
    with pytest.raises(DataError, match=r"line 1 of .*d\.jsonl.*nope\.png.*not found"):
        load_prompts(f, media_keys=KEYS)


def test_unreadable_media_names_row_and_file(tmp_path, vl_dir):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image")
    proc = MultimodalProcessor(str(vl_dir))
    with pytest.raises(MediaError, match=r"line 7 of x\.jsonl: image 0: cannot read image .*broken\.png"):
        proc.process("<image>", {"image": [str(bad)]}, where="line 7 of x.jsonl")


def test_placeholder_count_must_match(vl_dir, media):
    proc = MultimodalProcessor(str(vl_dir))
    with pytest.raises(DataError, match="2 <image> placeholder.*1 image"):
        proc.process("<image> and <image>", {"image": [str(media["image"])]})


def test_image_tokens_expanded_to_grid(vl_dir, media):
    proc = MultimodalProcessor(str(vl_dir))
    out = proc.process([{"role": "user", "content": "look <image>"}], {"image": [str(media["image"])]})
    grid = out.multimodal_inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 6]]  # 56 x 84 pixels in 14-pixel patches
    pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert out.prompt_ids.count(pad) == 6  # 2 x 2 patches merge into one token
    assert out.multimodal_inputs["pixel_values"].shape == (24, 1176)
    text = proc.tokenizer.decode(out.prompt_ids)
    assert "<|vision_start|>" + "<|image_pad|>" * 6 + "<|vision_end|>" in text


def test_video_fps_and_token_budget(vl_dir, media):
    cfg = MediaConfig(video_fps=2.0, video_max_tokens=4)
    out = MultimodalProcessor(str(vl_dir), cfg).process("<video>", {"video": [str(media["video"])]})
    t, h, w = out.multimodal_inputs["video_grid_thw"][0].tolist()
    assert t == 2  # 2 s at 2 fps = 4 frames = 2 temporal patches
    assert t * h * w // 4 <= 4 and h * w >= 4
    assert out.multimodal_inputs["second_per_grid_ts"].tolist() == [pytest.approx(1.0)]


def test_audio_features_and_tokens(omni_dir, media):
    proc = MultimodalProcessor(str(omni_dir))
    out = proc.process(
        "<audio> and <image>", {"audio": [str(media["audio"])], "image": [str(media["image"])]}
    )
    mm = out.multimodal_inputs
    assert mm["input_features"].shape == (1, 128, 100) and int(mm["feature_attention_mask"].sum()) == 100
    pad = proc.tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    assert out.prompt_ids.count(pad) == 25  # 100 mel frames -> 50 -> 25 tokens


def test_codec_round_trip():
    mm = {"pixel_values": torch.randn(4, 6), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    back = decode_inputs(encode_inputs(mm))
    assert all(torch.equal(back[k], mm[k]) for k in mm)
    with pytest.raises(ValueError, match="safetensors"):
        decode_inputs("!!!")


def test_pool_in_worker_process(tmp_path, vl_dir):
    import asyncio

    from relax.data.mm_pool import MediaPool

    f = generate_colors(tmp_path / "c.jsonl", n=3, inline=True)
    rows = load_prompts(f, media_keys=KEYS)
    local = MultimodalProcessor(str(vl_dir)).process(rows[0].prompt, rows[0].media)
    pool = MediaPool(str(vl_dir), MediaConfig(workers=1))
    try:
        out = asyncio.run(pool.process(rows[0]))
    finally:
        pool.close()
    assert out.prompt_ids == local.prompt_ids
    assert torch.equal(out.multimodal_inputs["pixel_values"], local.multimodal_inputs["pixel_values"])


def test_generators_write_loadable_rows(tmp_path):
    for gen, kind in ((generate_colors, "image"), (generate_tones, "audio")):
        rows = load_prompts(gen(tmp_path / f"{kind}.jsonl", n=4), media_keys=KEYS)
        assert len(rows) == 4 and all(len(r.media[kind]) == 1 for r in rows)
        assert all(r.label in {"0", "1", "2", "3"} for r in rows)
    buf = io.BytesIO()
    write_wav(buf, np.zeros(160, np.float32), 16000)
    assert buf.getvalue()[:4] == b"RIFF"
