"""Prefill past cached prefixes as one variable-length flash-attention call per layer.

A batch of prefix-cache hits (the next turn of 64 agent sessions, the later samples of a group) has
suffixes of T_u new tokens, each attending over its row's first K_u = start_u + T_u cache columns. The
masked path (`ModelRunner.prefill_after` without this) gathers every row's columns padded to the longest
row, repeats the key/value heads for the query heads (the memory-efficient kernel takes no grouped heads
with a mask) and reads a dense [U, 1, T, K] mask: its work and memory follow U x max T x max K. Here the
suffixes' real tokens are packed into [sum T_u, H_q, D], each row's columns into [sum K_u, H_kv, D]
(gathered out of the blocks), and flash attention's variable-length kernel runs them with its causal mask
aligned to the bottom right of each (T_u, K_u) pair, grouped heads and all: the work follows the tokens.

The engine takes it on CUDA with a 16-bit model (the flash kernel's); the CPU and float32 keep the masked
path. On the CPU `attend` runs one masked SDPA per suffix instead, which the tests use to check the
packing against the masked path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class PackedPrefill:
    """Where the real tokens and the attended columns of a right-padded suffix batch [U, T] lie."""

    q_index: Tensor  # [sum T_u] flat indices into U * T of the suffixes' real tokens
    cu_q: Tensor  # [U + 1] int32 prefix sums of T_u
    cu_k: Tensor  # [U + 1] int32 prefix sums of K_u
    max_q: int
    max_k: int
    k_rows: Tensor  # [sum K_u] the batch row of each attended column
    k_cols: Tensor  # [sum K_u] its cache column
    columns: int  # rotary positions run below this: the padding of suffix u runs to start_u + T - 1


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the variable-length flash kernel serves this device and dtype."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if not torch.backends.cuda.flash_sdp_enabled():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def plan(starts: list[int], lengths: list[int], T: int, device: torch.device) -> PackedPrefill:
    """The packing of suffixes of `lengths` tokens after `starts` cached columns, right-padded to T."""
    U = len(lengths)
    lens = torch.tensor(lengths, dtype=torch.long)
    cols_k = torch.tensor([s + n for s, n in zip(starts, lengths, strict=True)], dtype=torch.long)
    q_index = torch.cat([torch.arange(n) + u * T for u, n in enumerate(lengths)])
    k_rows = torch.repeat_interleave(torch.arange(U), cols_k)
    k_cols = torch.cat([torch.arange(k) for k in cols_k.tolist()])
    zero = torch.zeros(1, dtype=torch.long)
    return PackedPrefill(
        q_index=q_index.to(device, non_blocking=True),
        cu_q=torch.cat([zero, lens.cumsum(0)]).to(torch.int32).to(device, non_blocking=True),
        cu_k=torch.cat([zero, cols_k.cumsum(0)]).to(torch.int32).to(device, non_blocking=True),
        max_q=int(lens.max()),
        max_k=int(cols_k.max()),
        k_rows=k_rows.to(device, non_blocking=True),
        k_cols=k_cols.to(device, non_blocking=True),
        columns=max(starts) + T,
    )


def attend(q: Tensor, k: Tensor, v: Tensor, packed: PackedPrefill, scale: float) -> Tensor:
    """Attention of the padded suffix queries q [U, T, H_q, D] over the packed columns k, v
    [sum K_u, H_kv, D]; returns [U * T, H_q * D] with the padding's rows zero (never read)."""
    U, T, Hq, D = q.shape
    q_packed = q.reshape(U * T, Hq, D).index_select(0, packed.q_index)
    if q.device.type != "cuda":  # the reference the tests drive on the CPU: one masked SDPA per suffix
        out = _per_suffix(q_packed, k, v, packed, scale)
    else:
        out = _flash(q_packed, k, v, packed, scale)
    full = q.new_zeros(U * T, Hq * D)
    full.index_copy_(0, packed.q_index, out.reshape(-1, Hq * D))
    return full


def _flash(q: Tensor, k: Tensor, v: Tensor, packed: PackedPrefill, scale: float) -> Tensor:
    return torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        packed.cu_q,
        packed.cu_k,
        packed.max_q,
        packed.max_k,
        0.0,  # dropout
        True,  # causal: for the variable-length kernel, aligned to the bottom right of each pair
        False,  # no debug mask
        scale=scale,
    )[0]


def _per_suffix(q: Tensor, k: Tensor, v: Tensor, packed: PackedPrefill, scale: float) -> Tensor:
    cu_q, cu_k = packed.cu_q.tolist(), packed.cu_k.tolist()
    outs = []
    for u in range(len(cu_q) - 1):
        q_u = q[cu_q[u] : cu_q[u + 1]].transpose(0, 1)  # [H_q, T_u, D]
        k_u, v_u = (x[cu_k[u] : cu_k[u + 1]].transpose(0, 1) for x in (k, v))  # [H_kv, K_u, D]
        T_u, K_u = q_u.shape[1], k_u.shape[1]
        allowed = torch.arange(K_u)[None, :] <= torch.arange(K_u - T_u, K_u)[:, None]  # bottom right
        o = F.scaled_dot_product_attention(
            q_u, k_u, v_u, attn_mask=allowed.to(q.device), scale=scale, enable_gqa=True
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)
