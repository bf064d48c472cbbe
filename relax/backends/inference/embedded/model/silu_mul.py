"""The gated MLP's activation, silu(gate) * up, in one Triton kernel on CUDA, optionally with the
post-attention RMSNorm's row scale.

In torch the activation is two kernels and an intermediate (`F.silu(gate).mul_(up)`). The lean decoder
folds the RMSNorm's weight into its fused gate/up weight and projects the raw residual row x; the row scale
rsqrt(mean(x^2) + eps) then multiplies gate and up here, before the silu, so the norm costs no kernel of
its own (docs/measurements.md). Used in decode steps and prefills alike.
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
    def silu_mul(
        X, Y, Norm, inner, s_x, s_norm, H, eps,
        BLOCK: tl.constexpr, H_PAD: tl.constexpr, NORM: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0).to(tl.int64)  # a prefill's rows x 2I entries can pass 2**31
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = i < inner
        gate = tl.load(X + n * s_x + i, mask=keep, other=0.0).to(tl.float32)
        up = tl.load(X + n * s_x + inner + i, mask=keep, other=0.0).to(tl.float32)
        if NORM:
            j = tl.arange(0, H_PAD)
            x = tl.load(Norm + n * s_norm + j, mask=j < H, other=0.0).to(tl.float32)
            row_scale = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
            gate = gate * row_scale
            up = up * row_scale
        tl.store(Y + n * inner + i, (gate * tl.sigmoid(gate) * up).to(Y.dtype.element_ty), mask=keep)

    return silu_mul


def silu_mul(gate_up: Tensor, norm_of: Tensor | None = None, eps: float = 0.0) -> Tensor:
    """silu(gate) * up for gate_up = [gate | up] ([N, 2I], last dimension contiguous) in one pass; [N, I].
    With `norm_of` [N, hidden] (the rows the projection ran on), gate and up are first multiplied by
    rsqrt(mean(norm_of^2) + eps) per row."""
    N, two_i = gate_up.shape
    inner = two_i // 2
    out = torch.empty(N, inner, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    hidden = norm_of.shape[-1] if norm_of is not None else 1
    _kernel()[(N, -(-inner // block))](
        gate_up, out, norm_of if norm_of is not None else gate_up, inner, gate_up.stride(0),
        norm_of.stride(0) if norm_of is not None else 0, hidden, eps,
        BLOCK=block, H_PAD=1 << (hidden - 1).bit_length(), NORM=norm_of is not None, num_warps=4,
    )  # fmt: skip
    return out
