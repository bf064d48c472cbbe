"""A decode step's attention for one layer in one Triton kernel, on CUDA: the input RMSNorm's row scale,
the q/k/v bias, the rotary embedding, the cache write and the attention itself.

The lean decoder folds the input RMSNorm's weight into its fused q/k/v weight (`LeanDecoder.refresh`),
so the projection runs on the raw residual row x and RMSNorm(x) W^T + b = rsqrt(mean(x^2) + eps) (x W'^T)
+ b. This kernel applies that row scale and the bias to the projected heads, rotates q and k in float32,
writes the new key and value to the row's cache column and attends over the row's columns: the new
column straight from registers, the earlier ones from the cache, in tiles of `BLOCK_N` with an online
softmax (the attention loop of `decode_attention.py`, whose merge kernel joins the splits of a short
batch). A program takes one (row, kv head, split); only the split that holds the new column writes it.

Paged (`table` given, `paged_kv_cache.py`): column n of a row lives in block table[row, n // PAGE] at
offset n % PAGE of pools [blocks, H_kv, PAGE, D]; a tile of `BLOCK_N` columns reads its PAGE-token
pieces from wherever their blocks are (each piece contiguous), so a tile costs the same bytes as over a
contiguous slot. The splits (flash-decoding) keep the GPU busy when the batch is small and rows long.
Without a table the buffers are slots [S, H_kv, C, D] (a row's columns contiguous).

Why: the step had been four kernels a layer here (RMSNorm, rotary with the cache write, attention,
and the query heads' round trip through memory between them), each costing more than its work in
launch and memory round trips (`benchmarks/engine.py --profile`; docs/measurements.md). bf16 and fp16 only
(see `decode_attention.available`); captured CUDA graphs replay it, both variants compiled on the first
call outside a capture.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from relax.backends.inference.embedded.model import decode_attention as da


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["cols_per_split"])
    def step(
        QK, V, X, Bias, Cos, Sin, K_buf, V_buf, Table, Rows, Lens, Out, Part, Stats,
        s_qk_n, s_qk_h, s_v_n, s_v_h, s_x, s_cs, s_kb_s, s_kb_h, s_kb_c, s_vb_s, s_vb_h, s_vb_c, s_t,
        R, HQ, HK, H, eps, scale_log2, cols_per_split,
        R_PAD: tl.constexpr, D: tl.constexpr, H_PAD: tl.constexpr, BLOCK: tl.constexpr,
        SPLIT: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr, PAGE: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        nh = tl.num_programs(1)
        ns = tl.num_programs(2)
        pos = tl.load(Lens + b) - 1  # the new column; the row attends over 0..pos
        slot = tl.load(Rows + b)
        start = s * cols_per_split
        end = tl.minimum(start + cols_per_split, pos)  # this split's cached columns: [start, end)
        owner = (pos >= start) & (pos < start + cols_per_split)  # the split that holds the new column
        r = tl.arange(0, R_PAD)
        d = tl.arange(0, D)
        d_swap = (d + D // 2) % D
        if NORM:  # RMSNorm's row scale; its weight is folded into the projection
            i = tl.arange(0, H_PAD)
            x = tl.load(X + b * s_x + i, mask=i < H, other=0.0).to(tl.float32)
            row_scale = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
        else:
            row_scale = 1.0
        heads = h * R + r  # the query heads of kv head h
        q_mask = r[:, None] < R
        q_ptr = QK + b * s_qk_n + heads[:, None] * s_qk_h
        k_ptr = QK + b * s_qk_n + (HQ + h) * s_qk_h
        q = tl.load(q_ptr + d[None, :], mask=q_mask, other=0.0).to(tl.float32) * row_scale
        q_sw = tl.load(q_ptr + d_swap[None, :], mask=q_mask, other=0.0).to(tl.float32) * row_scale
        k = tl.load(k_ptr + d).to(tl.float32) * row_scale
        k_sw = tl.load(k_ptr + d_swap).to(tl.float32) * row_scale
        v_new = tl.load(V + b * s_v_n + h * s_v_h + d).to(tl.float32) * row_scale
        if BIAS:
            q += tl.load(Bias + heads[:, None] * D + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
            q_sw += tl.load(Bias + heads[:, None] * D + d_swap[None, :], mask=q_mask, other=0.0).to(
                tl.float32
            )
            k += tl.load(Bias + (HQ + h) * D + d).to(tl.float32)
            k_sw += tl.load(Bias + (HQ + h) * D + d_swap).to(tl.float32)
            v_new += tl.load(Bias + (HQ + HK + h) * D + d).to(tl.float32)
        cos = tl.load(Cos + b * s_cs + d).to(tl.float32)
        sin = tl.load(Sin + b * s_cs + d).to(tl.float32)  # sin_signed: [-sin_a, sin_b]
        dt = K_buf.dtype.element_ty
        q = (q * cos[None, :] + q_sw * sin[None, :]).to(dt)
        k = (k * cos + k_sw * sin).to(dt)
        v_new = v_new.to(dt)
        if PAGE > 0:  # paged: the new column's block from the row's table
            t_row = Table + slot.to(tl.int64) * s_t
            blk = tl.load(t_row + pos // PAGE).to(tl.int64)
            k_new_at = K_buf + blk * s_kb_s + h * s_kb_h + (pos % PAGE) * s_kb_c
            v_new_at = V_buf + blk * s_vb_s + h * s_vb_h + (pos % PAGE) * s_vb_c
        else:
            k_new_at = K_buf + slot * s_kb_s + h * s_kb_h + pos * s_kb_c
            v_new_at = V_buf + slot * s_vb_s + h * s_vb_h + pos * s_vb_c
        writes = d < tl.where(owner, D, 0)  # all of the head in the owner split, none elsewhere
        tl.store(k_new_at + d, k, mask=writes)
        tl.store(v_new_at + d, v_new, mask=writes)

        m_i = tl.full([R_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([R_PAD], tl.float32)
        acc = tl.zeros([R_PAD, D], tl.float32)
        # paged: each tile's blocks are looked up one tile ahead, so its key and value loads do not wait
        # on the table lookup of their own iteration
        blk_n = tl.zeros([BLOCK], tl.int64)
        if PAGE > 0:
            first = start + tl.arange(0, BLOCK)
            blk_n = tl.load(t_row + first // PAGE, mask=first < end, other=0).to(tl.int64)
        for n0 in range(start, end, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            valid = n < end
            if PAGE > 0:
                k_at = K_buf + h * s_kb_h + blk_n * s_kb_s + (n % PAGE) * s_kb_c
                v_at = V_buf + h * s_vb_h + blk_n * s_vb_s + (n % PAGE) * s_vb_c
                ahead = n + BLOCK
                blk_n = tl.load(t_row + ahead // PAGE, mask=ahead < end, other=0).to(tl.int64)
            else:
                k_at = K_buf + slot * s_kb_s + h * s_kb_h + n * s_kb_c
                v_at = V_buf + slot * s_vb_s + h * s_vb_h + n * s_vb_c
            kt = tl.load(k_at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(kt)) * scale_log2  # log2 domain
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(v_at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        if owner:  # the new column, from registers
            sc_new = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1) * scale_log2
            m_new = tl.maximum(m_i, sc_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(sc_new - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
            m_i = m_new
        row = (b * nh + h) * R  # output [B, H_kv, R, D], contiguous
        if SPLIT:
            at = ((b * nh + h) * ns + s) * R_PAD + r
            tl.store(Part + at[:, None] * D + d[None, :], acc)
            tl.store(Stats + at * 2, m_i)
            tl.store(Stats + at * 2 + 1, l_i)
        else:
            out = acc / l_i[:, None]
            tl.store(Out + (row + r[:, None]) * D + d[None, :], out.to(Out.dtype.element_ty), mask=q_mask)

    return step


_warmed: set[tuple] = set()


def attention_step(
    qk: Tensor,
    v: Tensor,
    cos: Tensor,
    sin_signed: Tensor,
    k_buf: Tensor,
    v_buf: Tensor,
    rows_N: Tensor,
    lengths_N: Tensor,
    columns: int,
    scale: float,
    x: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 0.0,
    table: Tensor | None = None,
) -> Tensor:
    """One decode token per row: rotate, cache and attend. Returns the attention output [N, Hq * D].

    qk [N, Hq + Hk, D] (query heads, then key heads) and v [N, Hk, D], as projected; with `x` [N, hidden]
    (the layer's input, RMSNorm's weight folded into the projection) they are first scaled by
    rsqrt(mean(x^2) + eps) per row, then `bias` [(Hq + 2 Hk) * D] (the fused q/k/v bias) is added.
    cos and sin_signed [N, D] (see `lean_decoder._rotary`); k_buf and v_buf [S, Hk, C, D] slots, or with
    `table` [rows, width] int32 pools of blocks [NB, Hk, PAGE, D]. Row n lives in slot (table row)
    rows_N[n], writes column lengths_N[n] - 1 and attends over columns 0..lengths_N[n] - 1, all below
    `columns` (which sets the splits). Every tensor's last dimension is contiguous."""
    N, Hk = qk.shape[0], v.shape[1]
    if cos.stride() != sin_signed.stride():
        cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    key = (qk.dtype, qk.shape[1:], qk.stride(), v.stride(), k_buf.shape, x is None, bias is None, qk.device)
    key += (None if table is None else table.shape,)
    if key not in _warmed and not (qk.is_cuda and torch.cuda.is_current_stream_capturing()):
        _warmed.add(key)  # compile both variants now, never inside a graph capture; their cache writes
        for splits in (1, 2):  # are the ones the call below makes again
            _launch(
                qk, v, cos, sin_signed, k_buf, v_buf, rows_N, lengths_N, columns, scale, x, bias, eps,
                splits, table,
            )  # fmt: skip
    splits = da.splits_for(N, Hk, columns)
    if table is not None and splits > 1:  # a small batch of long rows: each tile waits on a table lookup
        splits = min(2 * splits, -(-columns // da.BLOCK_N))  # before its loads; more programs hide it
    return _launch(
        qk, v, cos, sin_signed, k_buf, v_buf, rows_N, lengths_N, columns, scale, x, bias, eps, splits, table
    )


def _launch(
    qk: Tensor,
    v: Tensor,
    cos: Tensor,
    sin_signed: Tensor,
    k_buf: Tensor,
    v_buf: Tensor,
    rows_N: Tensor,
    lengths_N: Tensor,
    columns: int,
    scale: float,
    x: Tensor | None,
    bias: Tensor | None,
    eps: float,
    splits: int,
    table: Tensor | None = None,
    block: int | None = None,
    warps: int | None = None,
    stages: int | None = None,
) -> Tensor:
    """`block`, `warps`, `stages`: the tile width and launch settings (None: `decode_attention.step_config`
    for the head size; the sweep of `benchmarks/decode_kernels.py --step-sweep` varies them)."""
    N, H, D = qk.shape
    Hk = v.shape[1]
    Hq = H - Hk
    R = Hq // Hk
    R_PAD = max(16, 1 << (R - 1).bit_length())
    tile, tile_warps, tile_stages = da.step_config(D)
    block, warps, stages = block or tile, warps or tile_warps, stages or tile_stages
    cols = -(-columns // (splits * block)) * block  # columns per split, whole tiles
    out = torch.empty(N, Hk, R, D, dtype=qk.dtype, device=qk.device)
    if splits > 1:
        partial = torch.empty(N * Hk * splits * R_PAD, D, dtype=torch.float32, device=qk.device)
        stats = torch.empty(N * Hk * splits * R_PAD, 2, dtype=torch.float32, device=qk.device)
    else:
        partial = stats = out
    hidden = x.shape[-1] if x is not None else 1
    strides = (
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), x.stride(0) if x is not None else 0,
        cos.stride(0), *k_buf.stride()[:3], *v_buf.stride()[:3],
        table.stride(0) if table is not None else 0,
    )  # fmt: skip
    _kernel()[(N, Hk, splits)](
        qk, v, x if x is not None else qk, bias if bias is not None else qk, cos, sin_signed,
        k_buf, v_buf, table if table is not None else rows_N, rows_N, lengths_N, out, partial, stats,
        *strides, R, Hq, Hk, hidden, eps, scale * math.log2(math.e), cols,
        R_PAD=R_PAD, D=D, H_PAD=1 << (hidden - 1).bit_length(), BLOCK=block, SPLIT=splits > 1,
        NORM=x is not None, BIAS=bias is not None, PAGE=k_buf.shape[2] if table is not None else 0,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        merge = da._kernels()[1]
        merge[(N, Hk)](out, partial, stats, R, splits, R_PAD=R_PAD, D=D, num_warps=4)
    return out.view(N, Hq * D)
