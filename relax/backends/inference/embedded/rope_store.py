"""One Triton kernel for a decode step's rotary embedding and cache write, per layer, on CUDA (and one for
the MLP's silu(gate) * up).

In torch the rotary embedding of q and k is three kernels (the half swap, x * cos, the fused multiply-add)
and the cache write two more (keys and values, `index_put_`), each a few microseconds at decode sizes:
about 17 us of a layer's ~90. Here one program per (row, head) reads the head once, rotates it in float32
(one rounding, where torch rounds twice) and writes a query head to `q_out`, or a key head with its value
head into the row's cache slot at the row's column. Used with the Triton decode attention
(`LeanDecoder.triton_decode`); positions and rows are tensors, so CUDA graphs replay it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def rope_store(
        QK, V, Cos, Sin, Q_out, K_buf, V_buf, Rows, Pos,
        s_qk_n, s_qk_h, s_v_n, s_v_h, s_cs_n, s_kb_s, s_kb_h, s_kb_c, s_vb_s, s_vb_h, s_vb_c,
        HQ, D: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0)
        head = tl.program_id(1)
        half: tl.constexpr = D // 2
        d = tl.arange(0, D)
        x = tl.load(QK + n * s_qk_n + head * s_qk_h + d).to(tl.float32)
        swapped = tl.load(QK + n * s_qk_n + head * s_qk_h + (d + half) % D).to(tl.float32)
        cos = tl.load(Cos + n * s_cs_n + d).to(tl.float32)
        sin = tl.load(Sin + n * s_cs_n + d).to(tl.float32)  # sin_signed: [-sin_a, sin_b]
        y = x * cos + swapped * sin
        if head < HQ:
            tl.store(Q_out + (n * HQ + head) * D + d, y.to(Q_out.dtype.element_ty))
        else:
            kv = head - HQ
            slot = tl.load(Rows + n)
            col = tl.load(Pos + n)
            tl.store(K_buf + slot * s_kb_s + kv * s_kb_h + col * s_kb_c + d, y.to(K_buf.dtype.element_ty))
            v = tl.load(V + n * s_v_n + kv * s_v_h + d)
            tl.store(V_buf + slot * s_vb_s + kv * s_vb_h + col * s_vb_c + d, v)

    return rope_store


def rope_store(
    qk: Tensor,
    v: Tensor,
    cos: Tensor,
    sin_signed: Tensor,
    k_buf: Tensor,
    v_buf: Tensor,
    rows_N: Tensor,
    pos_N: Tensor,
) -> Tensor:
    """Rotate the query and key heads of one decode token per row and store keys and values in the cache.

    qk [N, Hq + Hk, D] (query heads, then key heads), v [N, Hk, D], cos and sin_signed [N, D] (see
    `lean_decoder._rotary`), k_buf and v_buf [S, Hk, C, D]; row n goes to slot rows_N[n], column pos_N[n].
    Every tensor's last dimension is contiguous. Returns the rotated queries [N, Hq, D]."""
    N, H, D = qk.shape
    Hk = v.shape[1]
    Hq = H - Hk
    q_out = torch.empty(N, Hq, D, dtype=qk.dtype, device=qk.device)
    if cos.stride() != sin_signed.stride():
        cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
    _kernel()[(N, H)](
        qk, v, cos, sin_signed, q_out, k_buf, v_buf, rows_N, pos_N,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        *k_buf.stride()[:3], *v_buf.stride()[:3],
        Hq, D=D, num_warps=1,
    )  # fmt: skip
    return q_out


@functools.cache
def _silu_mul_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul(X, Y, inner, s_x, BLOCK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)  # a prefill's rows x 2I entries can pass 2**31
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = i < inner
        gate = tl.load(X + n * s_x + i, mask=keep, other=0.0).to(tl.float32)
        up = tl.load(X + n * s_x + inner + i, mask=keep, other=0.0).to(tl.float32)
        tl.store(Y + n * inner + i, (gate * tl.sigmoid(gate) * up).to(Y.dtype.element_ty), mask=keep)

    return silu_mul


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for gate_up = [gate | up] ([N, 2I], last dimension contiguous) in one pass; [N, I].
    In torch it is two kernels and an intermediate (`F.silu(gate).mul_(up)`)."""
    N, two_i = gate_up.shape
    inner = two_i // 2
    out = torch.empty(N, inner, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel()[(N, -(-inner // block))](
        gate_up, out, inner, gate_up.stride(0), BLOCK=block, num_warps=4
    )
    return out
