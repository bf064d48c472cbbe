"""A video whose time positions run past its height and width (several temporal patches at two
positions a second): the text after it starts at the largest position so far plus one, as Qwen2-VL and
Qwen2.5-VL were trained, and the engine's generated tokens get the same positions from the trainer's
forward over prompt and response (fp32 log-probs within 1e-4). `transformers` 5 alone starts that text
after the video's spatial extent, where its own decode continues from the largest position: the engine
and the trainer then disagree (relax/models/multimodal_model.py)."""

from __future__ import annotations

import pytest
import torch

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.training import forward as fw
from relax.data.batch import TrainBatch
from relax.data.multimodal import MultimodalProcessor
from relax.models.multimodal_model import load_causal_lm, rope_positions
from relax.models.tiny import write_tiny_model
from relax.models.tiny_multimodal import PATCH_SIZE, TEMPORAL_PATCH, media_token_ids

T, H, W = 4, 2, 2  # temporal patches x patch rows x patch columns: 4 tokens once merged (2 x 2 -> 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("vl") / "qwen2_5_vl", family="qwen2_5_vl"))


@pytest.fixture(scope="module")
def video_prompt(model_dir) -> tuple[list[int], dict[str, torch.Tensor], int]:
    """Prompt ids (a word, the video, one short word), its media, and the index of the video's first token."""
    tok = MultimodalProcessor(model_dir).tokenizer
    ids = media_token_ids(tok)
    head = tok("watch").input_ids + [ids["vision_start_token_id"]]
    video = [ids["video_token_id"]] * T
    tail = [ids["vision_end_token_id"], *tok(" it").input_ids]
    g = torch.Generator().manual_seed(0)
    media = {
        "pixel_values_videos": torch.randn(T * H * W, 3 * TEMPORAL_PATCH * PATCH_SIZE**2, generator=g),
        "video_grid_thw": torch.tensor([[T, H, W]]),
        "second_per_grid_ts": torch.tensor([1.0]),  # x tokens_per_second 2: time positions 0, 2, 4, 6
    }
    return head + video + tail, media, len(head)


def test_text_after_a_video_starts_at_the_largest_position_plus_one(model_dir, video_prompt):
    model = load_causal_lm(model_dir)
    ids, media, first = video_prompt
    row = torch.tensor([ids])
    for pad in (0, 3):  # alone, and left-padded in a batch
        input_ids = torch.cat([torch.zeros(1, pad, dtype=torch.long), row], dim=1)
        mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(row)], dim=1)
        pos, delta = rope_positions(model, input_ids, mask, media)
        p = pos[:, 0, pad:]
        assert p[0, first : first + T].tolist() == [first + 2 * i for i in range(T)]  # time: 2 a second
        # the text after the video: max + 1 = first + 7, then one per token; `transformers` 5 gives first + 1
        after = p[:, first + T :]
        assert after.tolist() == [list(range(first + 7, first + 7 + after.shape[1]))] * 3
        assert int(delta[0]) == int(p.max()) + 1 - len(ids)


def test_engine_and_trainer_agree_after_a_long_video(model_dir, video_prompt):
    ids, media, _ = video_prompt
    engine = EmbeddedEngine(model_dir, device="cpu", dtype="float32", seed=0, threads=1).start()
    try:
        params = {"max_new_tokens": 6, "n": 2, "temperature": 1.0, "ignore_eos": True}
        results = engine.submit(ids, params, multimodal_inputs=media).result(timeout=120)
    finally:
        engine.shutdown()
    n = len(results)
    batch = TrainBatch(
        prompt_ids=[ids] * n,
        response_ids=[r.output_ids for r in results],
        loss_mask=[[1.0] * len(r.output_ids) for r in results],
        rollout_log_probs=[list(r.output_logprobs) for r in results],
        rewards=[0.0] * n,
        group_index=list(range(n)),
        weight_versions=[0] * n,
        multimodal_inputs=[media] * n,
    )
    model = load_causal_lm(model_dir).eval()
    got = fw.forward_rows(model, batch, [list(range(n))], torch.device("cpu"))
    for i, r in enumerate(results):
        torch.testing.assert_close(got[i], torch.tensor(r.output_logprobs), atol=1e-4, rtol=0)
