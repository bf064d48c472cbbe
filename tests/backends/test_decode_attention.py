"""The Triton decode kernels against PyTorch, on CUDA: attention (`decode_attention.py`: grouped query
heads, per-row lengths over a strided view of the slot cache, one split and several, replayed in a CUDA
graph), rotary embedding with the cache write (`rope_store.py`), and the engine's decode step with both
against the same step in torch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relax.backends.inference.embedded import decode_attention as da
from relax.backends.inference.embedded.lean_decoder import _rotary
from relax.backends.inference.embedded.rope_store import rope_store, silu_mul

CAN_RUN = torch.cuda.is_available() and da.available(torch.device("cuda"), torch.bfloat16, 64)
gpu = pytest.mark.skipif(not CAN_RUN, reason="needs CUDA and Triton")


def _reference(q, k, v, lengths, scale):
    """float32 attention with a mask; q [B, Hk, R, D], k/v [B, Hk, L, D]."""
    B, Hk, R, D = q.shape
    L = k.shape[2]
    allowed = torch.arange(L, device=q.device)[None, :] < lengths[:, None]  # [B, L]
    scores = torch.einsum("bhrd,bhld->bhrl", q.float(), k.float()) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    return torch.einsum("bhrl,bhld->bhrd", scores.softmax(-1), v.float())


def _cache_views(B, Hk, L, D, dtype, gen):
    """k, v as the engine passes them: [:B, :, :L] views of larger [S, Hk, C, D] buffers."""
    S, C = B + 3, L + 64
    k = torch.randn(S, Hk, C, D, generator=gen, device="cuda").to(dtype)
    v = torch.randn(S, Hk, C, D, generator=gen, device="cuda").to(dtype)
    return k[:B, :, :L], v[:B, :, :L]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B,Hk,R,D,L",
    [(256, 2, 7, 64, 384), (3, 2, 7, 64, 1000), (5, 4, 1, 128, 70), (1, 1, 8, 64, 1), (16, 8, 4, 128, 257)],
)
@gpu
def test_kernel_matches_attention(B, Hk, R, D, L, dtype):
    gen = torch.Generator(device="cuda").manual_seed(B * 1000 + L)
    qkv = torch.randn(B, 1, (R + 2) * Hk * D, generator=gen, device="cuda").to(dtype)
    q = qkv[..., : R * Hk * D].reshape(B, Hk, R, D)  # a strided view, as the lean decoder's
    k, v = _cache_views(B, Hk, L, D, dtype, gen)
    lengths = torch.randint(1, L + 1, (B,), generator=gen, device="cuda")
    lengths[0] = L
    scale = D**-0.5
    got = da.decode_attention(q, k, v, lengths, scale)
    want = _reference(q, k, v, lengths, scale)
    assert got.shape == (B, Hk, R, D) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    # the columns past a row's length are never read
    k2, v2 = k.clone(), v.clone()
    past = torch.arange(L, device="cuda")[None, :] >= lengths[:, None]
    k2.masked_fill_(past[:, None, :, None], float("nan"))
    v2.masked_fill_(past[:, None, :, None], float("nan"))
    torch.testing.assert_close(da.decode_attention(q, k2, v2, lengths, scale), got, atol=0, rtol=0)


def test_splits_follow_the_batch():  # pure Python: runs everywhere
    assert da.splits_for(256, 2, 384) == 1
    assert da.splits_for(4, 2, 4096) > 1
    assert da.splits_for(4, 2, 10) == 1  # never shorter than a tile
    assert not da.available(torch.device("cpu"), torch.bfloat16, 64)
    assert not da.available(torch.device("cuda"), torch.float32, 64)  # float32 keeps SDPA


@gpu
def test_replayed_in_a_cuda_graph_with_new_lengths():
    B, Hk, R, D, L = 8, 2, 7, 64, 512
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, Hk, R, D, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = _cache_views(B, Hk, L, D, torch.bfloat16, gen)
    lengths = torch.full((B,), 5, device="cuda")
    da.decode_attention(q, k, v, lengths, 0.125)  # outside the capture: compiles
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        out = da.decode_attention(q, k, v, lengths, 0.125)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    lengths.copy_(torch.randint(1, L + 1, (B,), generator=gen, device="cuda"))
    q.copy_(torch.randn(B, Hk, R, D, generator=gen, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out.float(), _reference(q, k, v, lengths, 0.125), atol=2e-2, rtol=2e-2)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_store_rotates_and_writes_the_cache(dtype):
    N, Hq, Hk, D, S, C = 6, 14, 2, 64, 9, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, generator=gen, device="cuda").to(dtype)
    qk = qkv[:, : (Hq + Hk) * D].unflatten(-1, (Hq + Hk, D))  # views, as the lean decoder's
    v = qkv[:, (Hq + Hk) * D :].unflatten(-1, (Hk, D))
    angle = torch.rand(N, D // 2, generator=gen, device="cuda") * 6
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
    sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)  # sin_signed
    k_buf = torch.zeros(S, Hk, C, D, dtype=dtype, device="cuda")
    v_buf = torch.zeros_like(k_buf)
    rows = torch.tensor([0, 1, 2, 3, 7, 8], device="cuda")
    pos = torch.tensor([0, 5, 127, 64, 3, 3], device="cuda")
    q = rope_store(qk, v, cos, sin, k_buf, v_buf, rows, pos)
    want = _rotary(qk.float(), cos.float()[:, None], sin.float()[:, None])
    torch.testing.assert_close(q.float(), want[:, :Hq], atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(k_buf[rows, :, pos].float(), want[:, Hq:], atol=2e-2, rtol=1e-2)
    assert torch.equal(v_buf[rows, :, pos], v)
    written = torch.zeros(S, C, dtype=torch.bool, device="cuda")
    written[rows, pos] = True
    assert not k_buf.transpose(1, 2)[~written].any() and not v_buf.transpose(1, 2)[~written].any()


@gpu
@pytest.mark.parametrize("N,inner", [(256, 4864), (3, 100), (1, 2048), (16384, 4864)])
def test_silu_mul(N, inner):
    gen = torch.Generator(device="cuda").manual_seed(N)
    gate_up = torch.randn(N, 2 * inner + 16, generator=gen, device="cuda").to(torch.bfloat16)[:, : 2 * inner]
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(silu_mul(gate_up).float(), want, atol=2e-2, rtol=1e-2)


@gpu
def test_engine_decode_step_agrees_with_torch_ops(tiny_model_dir):
    from relax.backends.inference.embedded.runner import ModelRunner

    runner = ModelRunner(str(tiny_model_dir), device="cuda", dtype="bfloat16", cuda_graphs=False)
    assert runner.lean is not None and runner.lean.triton_decode
    prompts = [[5, 6, 7, 8, 9], [11, 12], [3] * 40]
    runner.cache.reserve(len(prompts), 64, len(prompts))
    runner.prefill(prompts, list(range(len(prompts))))
    tokens = torch.tensor([1, 2, 3], device="cuda")
    pos = torch.tensor([len(p) for p in prompts], device="cuda")
    triton_logits = runner.decode(tokens, pos, int(pos.max()) + 1).float()
    runner.lean.triton_decode = False
    sdpa_logits = runner.decode(tokens, pos, int(pos.max()) + 1).float()
    assert F.cosine_similarity(triton_logits, sdpa_logits, dim=-1).min() > 0.999
    torch.testing.assert_close(triton_logits, sdpa_logits, atol=0.1, rtol=0.05)
