"""Decode attention on CUDA in Triton: one query token per row against its own columns of the slot cache,
the query heads of each key/value head computed together (grouped-query attention reads every key and
value once, never repeated per query head).

Row b attends to columns 0..lengths[b]-1 of its keys and values ([B, H_kv, L, D] views of the cache; the
columns past a row's length are never read). A program takes one (row, kv head, split of the columns):
it streams the split's keys and values in tiles of `BLOCK_N` columns, with an online softmax in float32
(the R query heads of the kv head padded to 16 rows, so both products run on tensor cores). With one
split (a full batch: 256 rows x 2 kv heads already make ~4 programs per SM of an H200) it writes the
normalised output; with more (small batches, long rows: flash-decoding) each split writes its partial
output, maximum and sum, and a second kernel merges them.

Why: PyTorch's memory-efficient SDPA was a large share of the decode step (docs/measurements.md) and
needs the additive mask built every step; this reads the cache once (`benchmarks/engine.py
--profile` shows both). bf16 and fp16 only; float32 models keep SDPA (tensor-core float32 would round
to tf32). Captured CUDA graphs replay it like any kernel: both variants (one split, several) are compiled
on the first call outside a capture, and the arguments that change with the batch are not specialised
on, so no capture ever compiles.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

# Key columns per tile, warps per program, software-pipelined tile loads: the fastest of `python
# benchmarks/decode_kernels.py --attention`'s sweep (docs/measurements.md); two warps suffice for a 16 x 64
# tile, and twice as many programs fit.
BLOCK_N = 64
WARPS = 2
STAGES = 3
TARGET_PROGRAMS = 264  # about two per SM of an H200 (132 SMs)
# A split shorter than this spends more on its prologue (loading and rotating the query) and on the merge
# kernel than its parallelism wins back (`decode_kernels.py --step-sweep`; the figures in
# docs/measurements.md)
MIN_SPLIT_COLUMNS = 512
DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Can `decode_attention` run here: CUDA, Triton, a half-precision dtype, head_dim a power of 2."""
    return (
        device.type == "cuda"
        and dtype in DTYPES
        and 16 <= head_dim <= 256
        and head_dim & (head_dim - 1) == 0
        and _triton()
    )


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["cols_per_split"])
    def part(
        Q, K, V, Lens, Out, Part, Stats,
        sq_b, sq_h, sq_r, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l,
        R, scale_log2, cols_per_split,
        R_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        nh = tl.num_programs(1)
        ns = tl.num_programs(2)
        length = tl.load(Lens + b)
        start = s * cols_per_split
        end = tl.minimum(start + cols_per_split, length)
        r = tl.arange(0, R_PAD)
        d = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + h * sq_h + r[:, None] * sq_r + d[None, :], mask=r[:, None] < R, other=0.0)
        m_i = tl.full([R_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([R_PAD], tl.float32)
        acc = tl.zeros([R_PAD, D], tl.float32)
        k_base = K + b * sk_b + h * sk_h
        v_base = V + b * sv_b + h * sv_h
        for n0 in range(start, end, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            valid = n < end
            k = tl.load(k_base + n[:, None] * sk_l + d[None, :], mask=valid[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k)) * scale_log2  # log2 domain
            qk = tl.where(valid[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * sv_l + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        row = (b * nh + h) * R  # output [B, H_kv, R, D], contiguous
        if SPLIT:
            at = ((b * nh + h) * ns + s) * R_PAD + r
            tl.store(Part + at[:, None] * D + d[None, :], acc)
            tl.store(Stats + at * 2, m_i)
            tl.store(Stats + at * 2 + 1, l_i)
        else:
            out = acc / l_i[:, None]
            tl.store(
                Out + (row + r[:, None]) * D + d[None, :], out.to(Out.dtype.element_ty), mask=r[:, None] < R
            )

    @triton.jit(do_not_specialize=["NS"])
    def merge(Out, Part, Stats, R, NS, R_PAD: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        nh = tl.num_programs(1)
        r = tl.arange(0, R_PAD)
        d = tl.arange(0, D)
        first = (b * nh + h) * NS
        m_max = tl.full([R_PAD], float("-inf"), tl.float32)
        for s in range(NS):
            m_max = tl.maximum(m_max, tl.load(Stats + ((first + s) * R_PAD + r) * 2))
        total = tl.zeros([R_PAD], tl.float32)
        acc = tl.zeros([R_PAD, D], tl.float32)
        for s in range(NS):
            at = (first + s) * R_PAD + r
            w = tl.exp2(tl.load(Stats + at * 2) - m_max)  # an empty split: exp2(-inf) = 0
            total += w * tl.load(Stats + at * 2 + 1)
            acc += w[:, None] * tl.load(Part + at[:, None] * D + d[None, :])
        out = acc / total[:, None]
        row = (b * nh + h) * R
        tl.store(Out + (row + r[:, None]) * D + d[None, :], out.to(Out.dtype.element_ty), mask=r[:, None] < R)

    return part, merge


def splits_for(batch: int, kv_heads: int, columns: int) -> int:
    """Splits of the columns: enough programs to fill the GPU, none shorter than `MIN_SPLIT_COLUMNS`."""
    want = -(-TARGET_PROGRAMS // (batch * kv_heads))
    return max(1, min(want, columns // MIN_SPLIT_COLUMNS))


def step_config(head_dim: int) -> tuple[int, int, int]:
    """(columns per tile, warps, pipeline stages) of the attention step for a head size. 64 (Qwen2.5-0.5B):
    the module's defaults. 128 (Qwen2.5-1.5B and up, the VL models): a [16, 128] query tile and its
    accumulator need four warps' registers; with two the step was 15-40% slower (docs/measurements.md)."""
    if head_dim <= 64:
        return BLOCK_N, WARPS, STAGES
    return BLOCK_N, 4, 2


_warmed: set[tuple] = set()


def decode_attention(q: Tensor, k: Tensor, v: Tensor, lengths_B: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale) v per row over its first lengths_B[b] columns: q [B, H_kv, R, D], k and v
    [B, H_kv, L, D] (views with a contiguous last dimension), lengths_B [B] int (1 <= lengths <= L).
    Returns [B, H_kv, R, D], contiguous."""
    B, Hk, _, _ = q.shape
    key = (q.dtype, q.shape[1:], q.stride(), k.stride(), v.stride(), q.device)
    if key not in _warmed and not torch.cuda.is_current_stream_capturing():
        _warmed.add(key)  # compile both variants for these strides now, never inside a graph capture
        _launch(q, k, v, lengths_B, scale, 1)
        _launch(q, k, v, lengths_B, scale, 2)
    return _launch(q, k, v, lengths_B, scale, splits_for(B, Hk, k.shape[2]))


def _launch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths_B: Tensor,
    scale: float,
    splits: int,
    block: int = BLOCK_N,
    warps: int = WARPS,
    stages: int = STAGES,
) -> Tensor:
    B, Hk, R, D = q.shape
    L = k.shape[2]
    part, merge = _kernels()
    R_PAD = max(16, 1 << (R - 1).bit_length())
    cols = -(-L // (splits * block)) * block  # columns per split, whole tiles
    out = torch.empty(B, Hk, R, D, dtype=q.dtype, device=q.device)
    if splits > 1:
        partial = torch.empty(B * Hk * splits * R_PAD, D, dtype=torch.float32, device=q.device)
        stats = torch.empty(B * Hk * splits * R_PAD, 2, dtype=torch.float32, device=q.device)
    else:
        partial = stats = out
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3])
    scale_log2 = scale * math.log2(math.e)
    part[(B, Hk, splits)](
        q, k, v, lengths_B, out, partial, stats, *strides, R, scale_log2, cols,
        R_PAD=R_PAD, D=D, BLOCK=block, SPLIT=splits > 1, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        merge[(B, Hk)](out, partial, stats, R, splits, R_PAD=R_PAD, D=D, num_warps=4)
    return out
