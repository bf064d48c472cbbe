"""A vision-language model's generation through the lean decoder equals the `transformers` path: the same
tokens and per-token log-probs (fp32, 1e-5), greedy and seeded sampling (a random tiny model's greedy
output repeats one token), for an image prompt, a text-only prompt and a video whose rotary positions run
ahead of the cache columns (a positive rope delta), each alone and batched together."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.data.multimodal import MultimodalProcessor
from relax.models.tiny import write_tiny_model
from relax.models.tiny_multimodal import PATCH_SIZE, TEMPORAL_PATCH, media_token_ids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("vl") / "qwen2_5_vl", family="qwen2_5_vl"))


@pytest.fixture(scope="module")
def requests(model_dir, tmp_path_factory) -> dict[str, tuple[list[int], dict | None]]:
    """Prompt ids and media by kind: an image, text only, and a two-token video 200 s per temporal patch
    (its mrope time index jumps by 400, so the rope delta is positive and the rotary positions pass the
    256 that a first CPU table covers)."""
    image = tmp_path_factory.mktemp("img") / "img.png"
    Image.fromarray((np.random.default_rng(0).random((56, 56, 3)) * 255).astype(np.uint8)).save(image)
    proc = MultimodalProcessor(model_dir)
    out = {
        "image": proc.process("look <image> now", {"image": [str(image)]}),
        "text": proc.process("plain text prompt", {}),
    }
    reqs = {kind: (o.prompt_ids, o.multimodal_inputs) for kind, o in out.items()}
    ids = media_token_ids(proc.tokenizer)
    video = [
        ids["vision_start_token_id"],
        ids["video_token_id"],
        ids["video_token_id"],
        ids["vision_end_token_id"],
    ]
    g = torch.Generator().manual_seed(0)
    media = {
        "pixel_values_videos": torch.randn(8, 3 * TEMPORAL_PATCH * PATCH_SIZE**2, generator=g),  # grid 2x2x2
        "video_grid_thw": torch.tensor([[2, 2, 2]]),  # 2 tokens once merged
        "second_per_grid_ts": torch.tensor([200.0]),
    }
    reqs["video"] = (proc.tokenizer("watch").input_ids + video + proc.tokenizer(" this").input_ids, media)
    return reqs


def generate(path: str, reqs: list, use_lean: bool) -> tuple[list, EmbeddedEngine]:
    """Each request greedy and sampled (its own seed): the results in that order."""
    engine = EmbeddedEngine(path, device="cpu", dtype="float32", seed=0, threads=1, use_lean=use_lean).start()
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    try:
        futures = [
            engine.submit(ids, params, multimodal_inputs=media)
            for i, (ids, media) in enumerate(reqs)
            for params in (greedy, {**greedy, "temperature": 1.0, "sampling_seed": i})
        ]
        return [f.result(timeout=120)[0] for f in futures], engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kinds", [["image"], ["text"], ["video"], ["image", "text", "video"]], ids="+".join)
def test_vl_generation_with_lean_decoder_equals_transformers(kinds, model_dir, requests):
    reqs = [requests[k] for k in kinds]
    lean, lean_engine = generate(model_dir, reqs, use_lean=True)
    plain, plain_engine = generate(model_dir, reqs, use_lean=False)
    assert lean_engine.runner.lean is not None and plain_engine.runner.lean is None
    assert (lean_engine.runner.rope_margin > 0) == ("video" in kinds)  # the video's delta is positive
    for a, b in zip(lean, plain, strict=True):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5, rtol=0
        )
