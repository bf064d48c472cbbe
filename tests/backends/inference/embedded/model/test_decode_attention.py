"""The Triton decode kernels against PyTorch, on CUDA: attention (`decode_attention.py`: grouped query
heads, per-row lengths over a strided view of the slot cache, one split and several, replayed in a CUDA
graph), the fused attention step (`attention_step.py`: row scale, bias, rotary embedding, cache write and
attention), a prefill's rotary embedding with the cache write (`prefill_rope.py`), silu(gate) * up with the norm's row scale (`silu_mul.py`), and the engine's decode step with
them against the same step in torch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relax.backends.inference.embedded.model import decode_attention as da
from relax.backends.inference.embedded.model.attention_step import attention_step
from relax.backends.inference.embedded.model.lean_decoder import _rotary
from relax.backends.inference.embedded.model.prefill_rope import rope_prefill
from relax.backends.inference.embedded.model.silu_mul import silu_mul

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


def _step_case(N, Hq, Hk, D, L, dtype, norm, bias, gen):
    """Inputs of `attention_step` as the lean decoder passes them (q/k and v views of one projection),
    over a cache of random contents in which rows live in scattered slots."""
    S, C, hidden = N + 5, L + 32, 96
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, generator=gen, device="cuda").to(dtype)
    qk = qkv[:, : (Hq + Hk) * D].unflatten(-1, (Hq + Hk, D))
    v = qkv[:, (Hq + Hk) * D :].unflatten(-1, (Hk, D))
    angle = torch.rand(N, D // 2, generator=gen, device="cuda") * 6
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
    sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)  # sin_signed
    k_buf = torch.randn(S, Hk, C, D, generator=gen, device="cuda").to(dtype)
    v_buf = torch.randn(S, Hk, C, D, generator=gen, device="cuda").to(dtype)
    rows = torch.randperm(S, generator=gen, device="cuda")[:N]
    lengths = torch.randint(1, L + 1, (N,), generator=gen, device="cuda")
    lengths[0] = L
    lengths[-1] = 1  # a row whose only column is the new one
    x = torch.randn(N, hidden, generator=gen, device="cuda").to(dtype) * 3 if norm else None
    b = torch.randn((Hq + 2 * Hk) * D, generator=gen, device="cuda").to(dtype) if bias else None
    return qk, v, cos, sin, k_buf, v_buf, rows, lengths, x, b


def _step_reference(qk, v, cos, sin, k_buf, v_buf, rows, lengths, L, scale, x, b, eps):
    """What `attention_step` computes, in float32 torch ops: (output [N, Hq * D], new k, new v)."""
    N, H, D = qk.shape
    Hk = v.shape[1]
    Hq = H - Hk
    qkv = torch.cat([qk.flatten(1), v.flatten(1)], 1).float()
    if x is not None:
        qkv = qkv * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    if b is not None:
        qkv = qkv + b.float()
    rot = _rotary(qkv[:, : H * D].view(N, H, D), cos.float()[:, None], sin.float()[:, None])
    q, k_new, v_new = rot[:, :Hq], rot[:, Hq:], qkv[:, H * D :].view(N, Hk, D)
    kc, vc = k_buf[rows].float(), v_buf[rows].float()
    at = torch.arange(N, device="cuda")
    kc[at, :, lengths - 1] = k_new
    vc[at, :, lengths - 1] = v_new
    out = _reference(q.view(N, Hk, Hq // Hk, D), kc[:, :, :L], vc[:, :, :L], lengths, scale)
    return out.reshape(N, Hq * D), k_new, v_new


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm,bias", [(True, True), (False, False), (True, False)])
@pytest.mark.parametrize(
    "N,Hq,Hk,D,L", [(256, 14, 2, 64, 384), (3, 14, 2, 64, 1000), (5, 4, 4, 128, 70), (16, 32, 8, 128, 257)]
)
def test_attention_step_rotates_writes_the_cache_and_attends(N, Hq, Hk, D, L, dtype, norm, bias):
    gen = torch.Generator(device="cuda").manual_seed(N * 7 + L)
    qk, v, cos, sin, k_buf, v_buf, rows, lengths, x, b = _step_case(N, Hq, Hk, D, L, dtype, norm, bias, gen)
    k_before, v_before = k_buf.clone(), v_buf.clone()
    want, k_new, v_new = _step_reference(qk, v, cos, sin, k_buf, v_buf, rows, lengths, L, D**-0.5, x, b, 1e-6)
    got = attention_step(qk, v, cos, sin, k_buf, v_buf, rows, lengths, L, D**-0.5, x=x, bias=b, eps=1e-6)
    assert got.shape == (N, Hq * D) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(k_buf[rows, :, lengths - 1].float(), k_new, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(v_buf[rows, :, lengths - 1].float(), v_new, atol=3e-2, rtol=2e-2)
    written = torch.zeros(k_buf.shape[0], k_buf.shape[2], dtype=torch.bool, device="cuda")
    written[rows, lengths - 1] = True
    untouched = ~written[:, None, :].expand(-1, Hk, -1)
    assert torch.equal(k_buf[untouched], k_before[untouched]) and torch.equal(
        v_buf[untouched], v_before[untouched]
    )


@gpu
def test_attention_step_replays_in_a_cuda_graph_with_new_lengths():
    N, Hq, Hk, D, L = 8, 14, 2, 64, 512
    gen = torch.Generator(device="cuda").manual_seed(3)
    qk, v, cos, sin, k_buf, v_buf, rows, lengths, x, b = _step_case(
        N, Hq, Hk, D, L, torch.bfloat16, True, True, gen
    )

    def call():
        return attention_step(qk, v, cos, sin, k_buf, v_buf, rows, lengths, L, 0.125, x=x, bias=b, eps=1e-6)

    call()  # outside the capture: compiles
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        out = call()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    lengths.copy_(torch.randint(1, L + 1, (N,), generator=gen, device="cuda"))
    qk.copy_(torch.randn(qk.shape, generator=gen, device="cuda"))
    want, _, _ = _step_reference(qk, v, cos, sin, k_buf, v_buf, rows, lengths, L, 0.125, x, b, 1e-6)
    graph.replay()
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_rope_rotates_in_place_and_writes_the_cache(dtype):
    N, T, Hq, Hk, D, S, C = 3, 37, 14, 2, 64, 7, 64
    gen = torch.Generator(device="cuda").manual_seed(2)
    qkv = torch.randn(N, T, (Hq + 2 * Hk) * D, generator=gen, device="cuda").to(dtype)
    qk = qkv[..., : (Hq + Hk) * D].unflatten(-1, (Hq + Hk, D))  # views, as the lean decoder's
    v = qkv[..., (Hq + Hk) * D :].unflatten(-1, (Hk, D))
    angle = torch.rand(N, T, D // 2, generator=gen, device="cuda") * 6
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)
    sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)  # sin_signed
    want = _rotary(qk.float(), cos.float()[:, :, None], sin.float()[:, :, None])
    v_before = v.clone()
    k_buf = torch.zeros(S, Hk, C, D, dtype=dtype, device="cuda")
    v_buf = torch.zeros_like(k_buf)
    rows = torch.tensor([5, 0, 3], device="cuda")
    rope_prefill(qk, v, cos, sin, k_buf, v_buf, rows)
    torch.testing.assert_close(qk.float(), want, atol=2e-2, rtol=1e-2)  # rotated in place
    assert torch.equal(v, v_before)
    torch.testing.assert_close(
        k_buf[rows, :, :T].float(), want[:, :, Hq:].transpose(1, 2), atol=2e-2, rtol=1e-2
    )
    assert torch.equal(v_buf[rows, :, :T], v.transpose(1, 2))
    untouched = torch.ones(S, dtype=torch.bool, device="cuda")
    untouched[rows] = False
    assert not k_buf[untouched].any() and not k_buf[rows, :, T:].any() and not v_buf[untouched].any()


@gpu
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("N,inner", [(256, 4864), (3, 100), (1, 2048), (16384, 4864)])
def test_silu_mul(N, inner, norm):
    gen = torch.Generator(device="cuda").manual_seed(N)
    gate_up = torch.randn(N, 2 * inner + 16, generator=gen, device="cuda").to(torch.bfloat16)[:, : 2 * inner]
    x = (
        torch.randn(N, 896 + 8, generator=gen, device="cuda").to(torch.bfloat16)[:, :896] * 4
        if norm
        else None
    )
    gu = gate_up.float()
    if norm:
        gu = gu * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(silu_mul(gate_up, x, 1e-6).float(), want, atol=2e-2, rtol=1e-2)


@gpu
def test_engine_decode_step_agrees_with_torch_ops(tiny_model_dir):
    from relax.backends.inference.embedded.model.runner import ModelRunner

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


def _paged(k_buf, v_buf, rows, L, page, gen):
    """The same cache contents in a paged layout: pools [NB, Hk, page, D], each row's blocks scattered
    at random (block 0 unused), and the block table."""
    S, Hk, C, D = k_buf.shape
    nb = -(-C // page)
    perm = torch.randperm(S * nb, generator=gen, device="cuda") + 1  # block 0: the engine's trash block
    table = perm.view(S, nb).to(torch.int32)
    k_pool = torch.zeros(S * nb + 1, Hk, page, D, dtype=k_buf.dtype, device="cuda")
    v_pool = torch.zeros_like(k_pool)
    pad = nb * page - C
    k_src = F.pad(k_buf, (0, 0, 0, pad)).view(S, Hk, nb, page, D).transpose(1, 2)
    v_src = F.pad(v_buf, (0, 0, 0, pad)).view(S, Hk, nb, page, D).transpose(1, 2)
    k_pool[table.long()] = k_src
    v_pool[table.long()] = v_src
    return k_pool, v_pool, table


@gpu
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("N,Hq,Hk,D,L", [(256, 14, 2, 64, 384), (3, 14, 2, 64, 4000), (16, 32, 8, 128, 257)])
def test_paged_attention_step_matches_the_contiguous_reference(N, Hq, Hk, D, L, page):
    """Block tables: the kernel reads each row's columns from scattered blocks (split-K for the long
    rows of a small batch) and writes the new column into its block, as over a contiguous slot."""
    gen = torch.Generator(device="cuda").manual_seed(N + L + page)
    qk, v, cos, sin, k_buf, v_buf, rows, lengths, x, b = _step_case(
        N, Hq, Hk, D, L, torch.bfloat16, True, True, gen
    )
    want, k_new, v_new = _step_reference(qk, v, cos, sin, k_buf, v_buf, rows, lengths, L, D**-0.5, x, b, 1e-6)
    k_pool, v_pool, table = _paged(k_buf, v_buf, rows, L, page, gen)
    got = attention_step(
        qk, v, cos, sin, k_pool, v_pool, rows, lengths, L, D**-0.5, x=x, bias=b, eps=1e-6, table=table
    )
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    col = lengths - 1
    blk = table[rows, col // page].long()
    torch.testing.assert_close(k_pool[blk, :, col % page].float(), k_new, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(v_pool[blk, :, col % page].float(), v_new, atol=3e-2, rtol=2e-2)
    assert not k_pool[0].any()  # block 0 is never written


@gpu
def test_paged_prefill_rope_writes_the_blocks_of_each_row():
    N, T, Hq, Hk, D, page = 3, 37, 14, 2, 64, 16
    gen = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(N, T, (Hq + 2 * Hk) * D, generator=gen, device="cuda").to(torch.bfloat16)
    qk = qkv[..., : (Hq + Hk) * D].unflatten(-1, (Hq + Hk, D))
    v = qkv[..., (Hq + Hk) * D :].unflatten(-1, (Hk, D))
    angle = torch.rand(N, T, D // 2, generator=gen, device="cuda") * 6
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(torch.bfloat16)
    sin = torch.cat([-angle.sin(), angle.sin()], -1).to(torch.bfloat16)
    want = _rotary(qk.float(), cos.float()[:, :, None], sin.float()[:, :, None])
    k_pool = torch.zeros(20, Hk, page, D, dtype=torch.bfloat16, device="cuda")
    v_pool = torch.zeros_like(k_pool)
    table = torch.zeros(6, 4, dtype=torch.int32, device="cuda")
    rows = torch.tensor([4, 0, 2], device="cuda")
    table[rows] = torch.arange(1, 13, device="cuda", dtype=torch.int32).flip(0).view(3, 4)[:, :]
    rope_prefill(qk, v, cos, sin, k_pool, v_pool, rows, table)
    for n in range(N):
        blocks = table[rows[n]].long()
        k_row = k_pool[blocks].transpose(0, 1).reshape(Hk, 4 * page, D)[:, :T]
        v_row = v_pool[blocks].transpose(0, 1).reshape(Hk, 4 * page, D)[:, :T]
        torch.testing.assert_close(k_row.float(), want[n, :, Hq:].transpose(0, 1), atol=2e-2, rtol=1e-2)
        assert torch.equal(v_row, v[n].transpose(0, 1))
