"""Decode steps replayed from CUDA graphs give the eager forward's logits, across batch and length buckets,
cache growth, weight updates and larger graphs standing in for new buckets; the bucket sizes and the
stand-in policy themselves are checked by hand (those two on any device)."""

from __future__ import annotations

import pytest
import torch

from relax.backends.inference.embedded.model.cuda_graphs import CAPTURE_AFTER, DecodeGraphs, bucket, stand_in
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


def test_stand_in_is_the_cheapest_covering_graph():
    captured = [(64, 1024), (16, 4096), (32, 512), (64, 256)]
    assert stand_in(captured, 16, 384) == (16, 4096)  # the fewest rows first, then the fewest columns
    assert stand_in(captured, 24, 384) == (32, 512)
    assert stand_in(captured, 40, 600) == (64, 1024)
    assert stand_in(captured, 8, 8192) is None  # nothing has the columns
    assert stand_in(captured, 72, 128) is None  # nothing has the rows
    assert stand_in([], 8, 128) is None


def test_a_new_bucket_is_captured_on_its_third_request_while_a_larger_graph_stands_in():
    """The policy alone (no CUDA): captured graphs are placeholders here."""
    graphs = DecodeGraphs(forward=None, cache=None, device=torch.device("cpu"))
    assert graphs._stand_in_or_capture((8, 128)) == (8, 128)  # nothing covers it: captured at once
    graphs.graphs[(8, 128)] = graphs.graphs[(32, 1024)] = object()
    for _ in range(CAPTURE_AFTER - 1):
        assert graphs._stand_in_or_capture((16, 512)) == (32, 1024)
    assert graphs._stand_in_or_capture((16, 512)) == (16, 512)  # it stays: its own graph now
    assert graphs.stood_in == CAPTURE_AFTER - 1 and not graphs._asked
    assert graphs._stand_in_or_capture((64, 128)) == (64, 128)  # no graph has its rows


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


@cuda
def test_a_larger_graph_stands_in_for_a_new_bucket_with_the_eager_logits(tmp_path):
    model_dir = write_tiny_model(tmp_path / "qwen2", family="qwen2", vocab_size=384)
    graphed = ModelRunner(str(model_dir), device="cuda", dtype="bfloat16")
    eager = ModelRunner(str(model_dir), device="cuda", dtype="bfloat16", cuda_graphs=False)
    long = [list(range(1, 181)), list(range(5, 150))]  # lengths 181-184: the graph of (8, 256)
    short = [list(range(1, 41)), [9, 10, 11], list(range(3, 60))]  # 60-65: the bucket (8, 128), new
    for prompts, n in ((long, 4), (short, CAPTURE_AFTER + 2)):
        for a, b in zip(steps(graphed, prompts, n), steps(eager, prompts, n), strict=True):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert set(graphed.graphs.graphs) == {(8, 256), (8, 128)}
    assert graphed.graphs.stood_in == CAPTURE_AFTER - 1
