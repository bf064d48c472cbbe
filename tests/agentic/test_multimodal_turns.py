"""An image returned by a tool reaches the next turn of a VLM: the sample's media grow by the image,
its placeholder tokens are expanded in the observation, and the engine generates the next turn with it
(the turn's log-probs equal the trainer's forward over the whole sequence with the image)."""

from __future__ import annotations

import pytest
import torch
from agentic_helpers import agent_config, run
from transformers import AutoTokenizer

from relax.agentic.rollout import agent_factory
from relax.backends.inference.embedded.http.server import EngineServer
from relax.data.dataset import PromptRow
from relax.models.multimodal_model import banned_token_ids, load_causal_lm, mask_media_logits, model_inputs
from relax.models.tiny import write_tiny_model
from relax.rewards import build_scorer
from relax.rollout.loop import RolloutLoop
from relax.rollout.router import Router


@pytest.fixture(scope="module")
def vl_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("vl") / "tiny-qwen2-vl", family="qwen2_vl")


def test_tool_image_is_carried_into_the_next_turn(vl_model_dir):
    tok = AutoTokenizer.from_pretrained(vl_model_dir)
    cfg = agent_config(
        vl_model_dir,
        kind="multi_turn",
        env="tests.agentic.agent_envs:make_image_tool",
        max_turns=3,
        max_total_tokens=400,
        end_on_truncated_turn=False,
    )
    server = EngineServer(str(vl_model_dir), port=0, seed=0, max_running=8, dtype="float32")
    server.start()

    async def episodes():
        router = Router([server.url], timeout_s=120)
        loop = RolloutLoop(cfg, tok, router, build_scorer(cfg.reward), agent_factory(cfg, tok))
        try:
            return await loop._generate_group(PromptRow(0, "Look."), 0, loop.sampling_params())
        finally:
            await router.close()

    try:
        samples = run(episodes())
    finally:
        server.stop()
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    start = tok.convert_tokens_to_ids("<|vision_start|>")
    model = load_causal_lm(vl_model_dir, dtype=torch.float32).eval()
    for s in samples:
        assert len(s.turns) == 3  # two observations with an image each, three model turns
        mm = s.multimodal_inputs
        grid = mm["image_grid_thw"]
        assert grid.shape == (2, 3)  # the two tool images, in order
        assert mm["pixel_values"].shape[0] == int(grid.prod(-1).sum())
        n_pads = [int(g.prod()) // 4 for g in grid]
        assert s.response_ids.count(pad) == sum(n_pads) and s.response_ids.count(start) == 2
        for t in s.turns[:2]:
            obs = s.response_ids[t["obs_start"] : t["obs_end"]]
            assert obs.count(pad) == n_pads[0] and all(
                m == 0 for m in s.loss_mask[t["obs_start"] : t["obs_end"]]
            )
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            kw = model_inputs(model, ids, torch.ones_like(ids), [mm])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).logits[0].float()
            logits = mask_media_logits(logits, banned_token_ids(model))  # as the engine and trainer do
        P = len(s.prompt_ids)
        logp = torch.log_softmax(logits, -1)[P - 1 : -1].gather(1, torch.tensor(s.response_ids)[:, None])[
            :, 0
        ]
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        third = slice(s.turns[2]["start"], s.turns[2]["end"])  # generated after both images
        assert torch.allclose(torch.tensor(s.rollout_log_probs)[third], logp[third], atol=2e-3)
        assert torch.allclose(torch.tensor(s.rollout_log_probs)[mask], logp[mask], atol=2e-3)
