"""A prefill's rotary embedding and cache write for one layer in one Triton kernel, on CUDA.

In torch ops the rotary embedding of q and k is three kernels over the prompt's [tokens, heads, D] (the
half swap, x * cos, the fused multiply-add) and the cache write two more (`index_put_` of keys and
values), a visible share of a prefill (`benchmarks/engine.py --profile`; docs/measurements.md). Here one
program per (token, head) reads the head once, rotates it in
float32 and writes it back in place (the projection's output, so SDPA reads q and k as views of it);
a key head also goes, with its value head, into the token's slot and column of the cache, or with a
block table (`paged_kv_cache.py`) into block table[row, column // PAGE] at offset column % PAGE.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rope_prefill(
        QK, V, Cos, Sin, K_buf, V_buf, Table, Rows,
        T, HQ, s_qk_t, s_qk_h, s_v_t, s_v_h, s_cs, s_kb_s, s_kb_h, s_kb_c, s_vb_s, s_vb_h, s_vb_c, s_t,
        D: tl.constexpr, PAGE: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)  # token of the [N * T] prompts
        head = tl.program_id(1)
        d = tl.arange(0, D)
        ptr = QK + t * s_qk_t + head * s_qk_h
        x = tl.load(ptr + d).to(tl.float32)
        swapped = tl.load(ptr + (d + D // 2) % D).to(tl.float32)
        cos = tl.load(Cos + t * s_cs + d).to(tl.float32)
        sin = tl.load(Sin + t * s_cs + d).to(tl.float32)  # sin_signed: [-sin_a, sin_b]
        y = (x * cos + swapped * sin).to(QK.dtype.element_ty)
        tl.debug_barrier()  # every thread has read the head before any overwrites it
        tl.store(ptr + d, y)
        if head >= HQ:
            kv = head - HQ
            slot = tl.load(Rows + t // T).to(tl.int64)
            col = t % T
            if PAGE > 0:
                slot = tl.load(Table + slot * s_t + col // PAGE).to(tl.int64)  # the block
                col = col % PAGE
            tl.store(K_buf + slot * s_kb_s + kv * s_kb_h + col * s_kb_c + d, y)
            v = tl.load(V + t * s_v_t + kv * s_v_h + d)
            tl.store(V_buf + slot * s_vb_s + kv * s_vb_h + col * s_vb_c + d, v)

    return rope_prefill


def rope_prefill(
    qk: Tensor,
    v: Tensor,
    cos: Tensor,
    sin_signed: Tensor,
    k_buf: Tensor,
    v_buf: Tensor,
    rows_N: Tensor,
    table: Tensor | None = None,
) -> None:
    """Rotate the query and key heads of N right-padded prompts of T tokens in place and store keys and
    values in the cache: token t of prompt n goes to slot rows_N[n], column t.

    qk [N, T, Hq + Hk, D] (query heads, then key heads) and v [N, T, Hk, D], with (N, T) flattening to one
    stride (views of the projection); cos and sin_signed [N, T, D] alike (see `lean_decoder._rotary`);
    k_buf and v_buf [S, Hk, C, D], or with `table` [rows, width] (rows_N its rows) pools of blocks
    [NB, Hk, PAGE, D]. Every tensor's last dimension is contiguous."""
    N, T, H, D = qk.shape
    Hk = v.shape[2]
    if cos.stride() != sin_signed.stride() or cos.stride(0) != T * cos.stride(1):
        cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    _kernel()[(N * T, H)](
        qk, v, cos, sin_signed, k_buf, v_buf, table if table is not None else rows_N, rows_N,
        T, H - Hk, qk.stride(1), qk.stride(2), v.stride(1), v.stride(2), cos.stride(1),
        *k_buf.stride()[:3], *v_buf.stride()[:3], table.stride(0) if table is not None else 0,
        D=D, PAGE=k_buf.shape[2] if table is not None else 0, num_warps=1,
    )  # fmt: skip
