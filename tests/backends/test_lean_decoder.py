"""The lean decoder gives the `transformers` forward's logits, prefill and decode, Qwen2 and Qwen3, and
follows weight updates."""

from __future__ import annotations

import pytest
import torch

from relax.backends.inference.embedded.runner import ModelRunner
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


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_lean_matches_transformers(family, tmp_path):
    model_dir = write_tiny_model(tmp_path / family, family=family, vocab_size=384)
    lean = ModelRunner(str(model_dir), dtype="float32")
    plain = ModelRunner(str(model_dir), dtype="float32", use_lean=False)
    assert lean.lean is not None and plain.lean is None
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
    for a, b in zip(run_steps(lean, prompts), run_steps(plain, prompts), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    name = "model.layers.0.self_attn.q_proj.weight"
    new = torch.randn_like(lean._params[name])
    lean.load_weights([(name, new)])
    plain.load_weights([(name, new)])
    torch.testing.assert_close(
        run_steps(lean, prompts)[-1], run_steps(plain, prompts)[-1], atol=1e-4, rtol=1e-4
    )
