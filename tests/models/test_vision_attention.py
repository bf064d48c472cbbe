"""The vision towers' window attention in batched calls (relax/models/vision_attention.py) gives what
transformers' one call per window gives: the attention itself on mixed window lengths, and whole Qwen2-VL
and Qwen2.5-VL towers (windowed and full-attention blocks) on images whose grids leave edge windows."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from relax.models.vision_attention import group_window_attention, windowed_attention


def test_windowed_attention_matches_one_call_per_window():
    g = torch.Generator().manual_seed(0)
    lengths = [16, 16, 16, 8, 16, 16, 4, 4, 12]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    H, S, D = 3, sum(lengths), 8
    q, k, v = (torch.randn(H, S, D, generator=g) for _ in range(3))
    want = torch.cat(
        [
            F.scaled_dot_product_attention(q[:, a:b], k[:, a:b], v[:, a:b], scale=0.3)
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
        ],
        dim=1,
    )
    torch.testing.assert_close(windowed_attention(q, k, v, cu, 0.3), want, rtol=1e-5, atol=1e-6)


def _tower(family: str):
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )

        # window_size 56 px: windows of 2 x 2 merged tokens, so a 6 x 10-patch grid has edge windows
        cfg = Qwen2_5_VLVisionConfig(
            depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
            window_size=56, fullatt_block_indexes=[1],
        )  # fmt: skip
    else:
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as Tower,
        )

        cfg = Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = Tower._from_config(cfg).eval()
    with torch.no_grad():  # weights large enough for peaked attention: a wrong window or scale shows
        for p in tower.parameters():
            p.normal_(0.0, 0.3)
    return tower, cfg


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_a_batched_tower_gives_the_towers_output(family):
    tower, cfg = _tower(family)
    batched = copy.deepcopy(tower)
    assert group_window_attention(batched) == cfg.depth
    grid = torch.tensor([[1, 8, 8], [1, 6, 10], [2, 4, 4]])  # two images and a two-frame video
    features = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    pixels = torch.randn(int(grid.prod(-1).sum()), features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = tower(pixels, grid_thw=grid), batched(pixels, grid_thw=grid)
    want, got = (getattr(o, "pooler_output", o) for o in (want, got))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_text_model_is_left_alone(tiny_model_dir):
    from relax.models.multimodal_model import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    assert group_window_attention(model) == 0
