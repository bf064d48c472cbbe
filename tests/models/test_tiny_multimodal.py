"""Tiny multimodal checkpoints: every family loads like a real one (model, tokenizer, processor configs),
runs forward/backward on media, and the embedded engine's log-probs agree with the trainer's for image,
video, audio and mixed prompts (fp32, |engine - trainer| < 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.training import forward as fw
from relax.data.batch import TrainBatch
from relax.data.media import write_wav
from relax.data.multimodal import MultimodalProcessor
from relax.models.multimodal_model import banned_token_ids, load_causal_lm, model_inputs
from relax.models.tiny import count_parameters, write_tiny_model

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni"]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    Image.fromarray((np.random.default_rng(0).random((56, 56, 3)) * 255).astype(np.uint8)).save(d / "img.png")
    write_wav(d / "a.wav", 0.5 * np.sin(np.arange(8000) / 16000 * 2 * np.pi * 440), 16000)
    frames = [Image.fromarray(np.full((56, 56, 3), 40 * i, np.uint8)) for i in range(4)]
    frames[0].save(d / "v.gif", save_all=True, append_images=frames[1:], duration=500, loop=0)
    return {k: str(d / f) for k, f in (("image", "img.png"), ("audio", "a.wav"), ("video", "v.gif"))}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm-models")
    return {f: write_tiny_model(root / f, family=f) for f in FAMILIES}


def prompts_for(family: str, media: dict[str, str]) -> list[tuple[str, dict]]:
    items = [("look <image> now", {"image": [media["image"]]}), ("plain text", {})]
    if "omni" in family:
        items += [("hear <audio>", {"audio": [media["audio"]]})]
        items += [("see <image> hear <audio>", {"image": [media["image"]], "audio": [media["audio"]]})]
    elif family != "qwen3_vl":
        items += [("watch <video>", {"video": [media["video"]]})]
    return items


@pytest.mark.parametrize("family", FAMILIES)
def test_family_builds_and_trains(family, model_dirs, media):
    path = model_dirs[family]
    assert (path / "preprocessor_config.json").exists() and (path / "tokenizer_config.json").exists()
    model = load_causal_lm(path)
    assert 100_000 <= count_parameters(model) <= 300_000
    proc = MultimodalProcessor(str(path))
    text, mm = [x for x in prompts_for(family, media) if x[1]][-1]  # image+audio for Omni
    out = proc.process(text, mm)
    ids = torch.tensor([out.prompt_ids])
    attn = torch.ones_like(ids)
    logits = model(
        input_ids=ids, attention_mask=attn, **model_inputs(model, ids, attn, [out.multimodal_inputs])
    ).logits
    logits[0, -1].logsumexp(-1).backward()
    assert model.lm_head.weight.grad is not None
    encoder = model.model.visual if "audio" not in mm else model.model.audio_tower
    assert any(
        p.grad is not None and p.grad.abs().sum() > 0 for p in encoder.parameters()
    )  # media reach the loss
    assert banned_token_ids(model)  # media tokens are never sampled


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_and_trainer_log_probs_agree(family, model_dirs, media):
    path = str(model_dirs[family])
    proc = MultimodalProcessor(path)
    items = [proc.process(t, m) for t, m in prompts_for(family, media)]
    engine = EmbeddedEngine(path, device="cpu", dtype="float32", seed=0, threads=1).start()
    try:
        params = {"max_new_tokens": 5, "n": 2, "temperature": 1.0, "ignore_eos": True}
        futures = [
            engine.submit(it.prompt_ids, params, multimodal_inputs=it.multimodal_inputs) for it in items
        ]
        results = [f.result(timeout=120) for f in futures]
    finally:
        engine.shutdown()
    prompts, responses, engine_lps, mms = [], [], [], []
    for it, rs in zip(items, results, strict=True):
        for r in rs:
            prompts.append(it.prompt_ids)
            responses.append(r.output_ids)
            engine_lps.append(torch.tensor(r.output_logprobs))
            mms.append(it.multimodal_inputs)
    n = len(prompts)
    batch = TrainBatch(
        prompt_ids=prompts,
        response_ids=responses,
        loss_mask=[[1.0] * len(r) for r in responses],
        rollout_log_probs=[lp.tolist() for lp in engine_lps],
        rewards=[0.0] * n,
        group_index=list(range(n)),
        weight_versions=[0] * n,
        multimodal_inputs=mms,
    )
    model = load_causal_lm(path).eval()
    got = fw.forward_rows(model, batch, [list(range(n))], torch.device("cpu"))  # one padded micro-batch
    alone = fw.forward_rows(model, batch, [[i] for i in range(n)], torch.device("cpu"))  # unpadded
    for i in range(n):
        assert torch.allclose(got[i], engine_lps[i], atol=1e-4), (family, i)
        assert torch.allclose(alone[i], engine_lps[i], atol=1e-4), (family, i)


def test_engine_rejects_mismatched_media(model_dirs, media):
    path = str(model_dirs["qwen2_5_vl"])
    out = MultimodalProcessor(path).process("look <image>", {"image": [media["image"]]})
    engine = EmbeddedEngine(path, device="cpu", dtype="float32").start()
    try:
        with pytest.raises(ValueError, match="media tokens"):
            engine.submit(
                out.prompt_ids[:-8] + out.prompt_ids[-4:], {}, multimodal_inputs=out.multimodal_inputs
            )
    finally:
        engine.shutdown()
