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


def _encoder_inputs(model) -> list[int]:
    """Patches (vision) and feature frames (audio) each encoder call received."""
    seen: list[int] = []
    for name, axis in (("visual", 0), ("audio_tower", -1)):  # pixels [patches, dim]; audio [mel, frames]
        enc = getattr(model.model, name, None) or getattr(model, name, None)
        if enc is not None:
            enc.register_forward_pre_hook(lambda _m, args, axis=axis: seen.append(int(args[0].shape[axis])))
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_each_distinct_media_item_is_encoded_once(family, model_dirs, media, monkeypatch):
    """GRPO's repeated media: a micro-batch of 3 samples per prompt runs each prompt's media through the
    encoders once, with the same log-probs, entropy and gradients as encoding every sample's copy."""
    import relax.models.media_dedup as dedup

    path = str(model_dirs[family])
    proc = MultimodalProcessor(path)
    items = [proc.process(t, m) for t, m in prompts_for(family, media)]
    g = torch.Generator().manual_seed(0)
    rows = [(it, torch.randint(5, 50, (4,), generator=g).tolist()) for it in items for _ in range(3)]
    batch = TrainBatch(
        prompt_ids=[it.prompt_ids for it, _ in rows],
        response_ids=[r for _, r in rows],
        loss_mask=[[1.0] * 4 for _ in rows],
        rollout_log_probs=[[0.0] * 4 for _ in rows],
        rewards=[0.0] * len(rows),
        group_index=list(range(len(rows))),
        weight_versions=[0] * len(rows),
        # each sample its own copy of the tensors, as rows arrive from the data plane
        multimodal_inputs=[
            {k: v.clone() for k, v in it.multimodal_inputs.items()} if it.multimodal_inputs else None
            for it, _ in rows
        ],
    )
    results = {}
    for mode in ("dedupe", "every_copy"):
        model = load_causal_lm(path).train()
        seen = _encoder_inputs(model)
        if mode == "every_copy":
            monkeypatch.setattr(dedup, "plan_media", lambda *a, **k: None)
        mb = fw.micro_batch(model, batch, list(range(len(rows))), torch.device("cpu"))
        logp, ent = fw.policy_forward(model, mb, with_entropy=True)
        (logp.sum() + 0.1 * ent.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[mode] = (logp.detach(), ent.detach(), grads, sum(seen))
    (lp1, e1, g1, n1), (lp0, e0, g0, n0) = results["dedupe"], results["every_copy"]
    assert n1 * 3 == n0  # every encoder input once instead of three times
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e1, e0, atol=1e-5, rtol=1e-5)
    assert g1.keys() == g0.keys()
    encoder = [n for n in g0 if "visual" in n or "audio_tower" in n]
    assert encoder and any(float(g0[n].abs().max()) > 0 for n in encoder)  # media reach the loss
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)
