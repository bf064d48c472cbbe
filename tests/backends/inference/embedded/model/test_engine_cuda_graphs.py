"""Decode steps replayed from CUDA graphs give the eager forward's logits, across batch and length buckets,
cache growth and weight updates; the bucket sizes themselves are checked by hand."""

from __future__ import annotations

import pytest
import torch

from relax.backends.inference.embedded.model.cuda_graphs import bucket
from relax.backends.inference.embedded.model.runner import ModelRunner
from relax.models.tiny import write_tiny_model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_buckets():
    assert [bucket(n, 8) for n in (1, 5, 8, 9, 16, 17, 33, 100, 250, 256, 257)] == [
        8, 8, 8, 16, 16, 24, 40, 112, 256, 256, 320,
    ]  # fmt: skip
    assert [bucket(n, 128) for n in (1, 128, 129, 300, 513, 1025, 4000)] == [
        128, 128, 256, 384, 640, 1280, 4096,
    ]  # fmt: skip


def steps(runner: ModelRunner, prompts: list[list[int]], n: int) -> list[torch.Tensor]:
    """Prefill, then n greedy decode steps of the whole batch; the logits of every step."""
    runner.cache.reserve(8, 200, 8)  # 8 slots: a batch of 3 runs the graph of 8 rows
    logits = [runner.prefill(prompts, list(range(len(prompts))))]
    pos_B = torch.tensor([len(p) for p in prompts], device=runner.device)
    for _ in range(n):
        tokens_B = logits[-1].argmax(dim=-1)
        logits.append(runner.decode(tokens_B, pos_B, int(pos_B.max()) + 1).clone())
        pos_B = pos_B + 1
    return logits


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the Triton decode kernels, captured
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_graph_decode_matches_eager(family, dtype, tmp_path):
    model_dir = write_tiny_model(tmp_path / family, family=family, vocab_size=384)
    graphed = ModelRunner(str(model_dir), device="cuda", dtype=dtype)
    eager = ModelRunner(str(model_dir), device="cuda", dtype=dtype, cuda_graphs=False)
    tol = 1e-4 if dtype == "float32" else 2e-2
    assert graphed.graphs is not None and eager.graphs is None
    # 3 rows (batch bucket 4), lengths crossing the first length bucket (128)
    prompts = [list(range(1, 121)), [7, 8], list(range(30, 90))]
    for a, b in zip(steps(graphed, prompts, 12), steps(eager, prompts, 12), strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert len(graphed.graphs.graphs) >= 2
    name = "model.layers.0.mlp.gate_proj.weight"  # fused into gate_up_w, which the graphs hold
    new = torch.randn_like(graphed._params[name])
    graphed.load_weights([(name, new)])
    eager.load_weights([(name, new)])
    torch.testing.assert_close(
        steps(graphed, prompts, 3)[-1], steps(eager, prompts, 3)[-1], atol=tol, rtol=tol
    )
