"""The lean decoder gives the `transformers` forward's logits, prefill and decode, Qwen2 and Qwen3, and
follows weight updates."""

from __future__ import annotations

import pytest
import torch

from relax.backends.inference.embedded.model.runner import ModelRunner
from relax.models.tiny import write_tiny_model


def run_steps(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    runner.cache.reserve(len(prompts), 64, len(prompts))
    logits = [runner.prefill(prompts, list(range(len(prompts))))]
    pos_B = torch.tensor([len(p) for p in prompts])
    for _ in range(3):
        tokens_B = logits[-1].argmax(dim=-1)
        logits.append(runner.decode(tokens_B, pos_B, int(pos_B.max()) + 1))
        pos_B = pos_B + 1
    return logits


@pytest.mark.parametrize("fold", [False, True], ids=["plain", "folded_norms"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_lean_matches_transformers(family, fold, tmp_path):
    """`fold`: the RMSNorm weights folded into the projections, as on CUDA with the Triton kernels (here
    through the torch ops that apply the row scale after the product)."""
    model_dir = write_tiny_model(tmp_path / family, family=family, vocab_size=384)
    lean = ModelRunner(str(model_dir), dtype="float32")
    plain = ModelRunner(str(model_dir), dtype="float32", use_lean=False)
    assert lean.lean is not None and plain.lean is None
    assert not lean.lean.fold_norms  # the CPU default
    if fold:
        lean.lean.fold_norms = True
        lean.lean.refresh()
        assert lean.lean.layers[0]["fold2"] and lean.lean.layers[0]["fold1"] == (family == "qwen2")
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
    for a, b in zip(run_steps(lean, prompts), run_steps(plain, prompts), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    updates = [  # a projection and both norms: a folded copy must follow all three
        (name, 1 + torch.randn_like(lean._params[name]) * (0.5 if "norm" in name else 1))
        for name in (
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight",
        )
    ]
    lean.load_weights(updates)
    plain.load_weights(updates)
    torch.testing.assert_close(
        run_steps(lean, prompts)[-1], run_steps(plain, prompts)[-1], atol=1e-4, rtol=1e-4
    )
