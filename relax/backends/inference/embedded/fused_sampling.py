"""Sampling in one pass over the logits on CUDA (a Triton kernel), for the common RL batch: every row
sampled at its own temperature > 0, no top-k / top-p / min-p.

Per row b the kernel reads the logits x_b once and keeps, lane by lane,

    the running maximum and sum of exp(x_b / T_b)     -> lse_b = logsumexp(x_b / T_b)
    the running arg-max of x_b[v] / T_b + G_b[v]      -> the token (Gumbel-max, G = -log(-log(U)))

and writes the token and its log-prob x_b[token] / T_b - lse_b. The Gumbel-max draw is exact: argmax of
x / T + Gumbel noise is distributed as softmax(x / T), like the exponential race of `sampling.py`, which
is the same race in probability space. The uniform numbers come from Philox keyed by a per-row seed and
the vocabulary index (`tl.rand4x`: one Philox call for four entries), so a row's draw depends only on its seed: `BatchSampler` draws the seeds of a step
from the engine's generator, a seeded request's from its own (the same tokens whatever else is batched).

On an H200 at 256 rows x 151936 (bf16 logits) the torch ops of `BatchSampler._race` make six passes over
[256, V] float32 tensors (log-softmax, exp, the draw, its log, the division, the arg-min): 0.66 ms of a
3.5 ms decode step. This kernel reads the bf16 logits once: 0.16 ms (`python benchmarks/sampler.py
--device cuda --rows 256 --vocab 151936` times both; at 64 rows 0.10 ms against 0.21). Without Triton or CUDA, `available()` is False and the
torch path runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

SUB = 1024  # lanes of a program; it reads 4 x SUB vocabulary entries per iteration
WARPS = 8
PROGRAMS = 512  # programs to aim for (rows x parts): a few per SM of an H200's 132
SEED_MAX = 2**31 - 1


@functools.cache
def available() -> bool:
    """Triton importable and a CUDA device present."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def _visit(base, offs, V, inv_t, u, run_max, run_sum, best, best_at):
        """Fold one tile of the row (entries `offs`, uniforms `u`) into the lane accumulators."""
        inside = offs < V
        x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
        new_max = tl.maximum(run_max, x)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a lane that saw only -inf
        run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(x - shift)
        score = tl.where(inside, x - tl.log(-tl.log(u)), float("-inf"))
        better = score > best
        return new_max, run_sum, tl.where(better, score, best), tl.where(better, offs, best_at)

    # arguments that vary with the batch are not specialised on, so a new batch size compiles nothing
    @triton.jit(do_not_specialize=["chunks_per_part"])
    def scan_part(
        logits_ptr, stride, inv_temp_ptr, seed_ptr, part_ptr, V, chunks_per_part, SUB: tl.constexpr
    ):
        """Program (row, part): the row's chunks [part * chunks_per_part, ...) of 4 x SUB entries.
        Writes [max, sum of exp(x - max), best score, its index] at part_ptr[row, part, :] (float32:
        exact for indexes below 2**24)."""
        row, part, parts = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        base = logits_ptr + row.to(tl.int64) * stride
        inv_t = tl.load(inv_temp_ptr + row)
        seed = tl.load(seed_ptr + row)
        lanes = tl.arange(0, SUB)
        run_max = tl.full((SUB,), float("-inf"), tl.float32)
        run_sum = tl.zeros((SUB,), tl.float32)
        best = tl.full((SUB,), float("-inf"), tl.float32)
        best_at = tl.zeros((SUB,), tl.int32)
        first = part * chunks_per_part * 4 * SUB
        last = tl.minimum(first + chunks_per_part * 4 * SUB, V)
        for start in range(first, last, 4 * SUB):
            # one Philox call gives four uniforms, keyed by the vocabulary index: the same draw
            # whatever the split
            u0, u1, u2, u3 = tl.rand4x(seed, start // 4 + lanes)
            run_max, run_sum, best, best_at = _visit(
                base, start + lanes, V, inv_t, u0, run_max, run_sum, best, best_at
            )
            run_max, run_sum, best, best_at = _visit(
                base, start + SUB + lanes, V, inv_t, u1, run_max, run_sum, best, best_at
            )
            run_max, run_sum, best, best_at = _visit(
                base, start + 2 * SUB + lanes, V, inv_t, u2, run_max, run_sum, best, best_at
            )
            run_max, run_sum, best, best_at = _visit(
                base, start + 3 * SUB + lanes, V, inv_t, u3, run_max, run_sum, best, best_at
            )
        top = tl.max(run_max, 0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        best_score = tl.max(best, 0)
        out = part_ptr + (row * parts + part) * 4
        tl.store(out, top)
        tl.store(out + 1, tl.sum(run_sum * tl.exp(run_max - shift), 0))
        tl.store(out + 2, best_score)
        tl.store(out + 3, tl.min(tl.where(best == best_score, best_at, V), 0).to(tl.float32))

    @triton.jit(do_not_specialize=["parts"])
    def combine(logits_ptr, stride, inv_temp_ptr, part_ptr, token_ptr, logp_ptr, parts, P: tl.constexpr):
        """One program per row: the parts' log-sum-exp, the best part's token (ties: the first part,
        whose indexes are the smallest) and the token's log-prob."""
        row = tl.program_id(0)
        k = tl.arange(0, P)
        inside = k < parts
        part = part_ptr + (row * parts + k) * 4
        pmax = tl.load(part, mask=inside, other=float("-inf"))
        psum = tl.load(part + 1, mask=inside, other=0.0)
        pbest = tl.load(part + 2, mask=inside, other=float("-inf"))
        pat = tl.load(part + 3, mask=inside, other=0.0)
        top = tl.max(pmax, 0)
        lse = top + tl.log(tl.sum(psum * tl.exp(pmax - top), 0))
        best_score = tl.max(pbest, 0)
        token = tl.min(tl.where(pbest == best_score, k, P), 0)
        token = tl.sum(tl.where(k == token, pat, 0.0), 0).to(tl.int64)
        chosen = tl.load(logits_ptr + row.to(tl.int64) * stride + token).to(tl.float32) * tl.load(
            inv_temp_ptr + row
        )
        tl.store(token_ptr + row, token)
        tl.store(logp_ptr + row, chosen - lse)

    return scan_part, combine


def fused_sample(logits_BV: Tensor, inv_temp_B: Tensor, seeds_B: Tensor) -> tuple[Tensor, Tensor]:
    """Token ids [B] (int64) and their log-probs [B] (float32) of one draw per row from
    softmax(logits / T); `inv_temp_B` holds 1 / T (float32), `seeds_B` the rows' Philox seeds (int32).

    A row is split into parts scanned in parallel, enough for about `PROGRAMS` programs in all: a
    program per row alone would leave a small batch's rows to a few SMs, each scanning 150k entries."""
    B, V = logits_BV.shape
    if logits_BV.stride(1) != 1:
        logits_BV = logits_BV.contiguous()
    chunks = -(-V // (4 * SUB))
    parts = max(1, min(chunks, -(-PROGRAMS // B)))
    per_part = -(-chunks // parts)
    parts = -(-chunks // per_part)  # no empty part
    partial = torch.empty(B, parts, 4, dtype=torch.float32, device=logits_BV.device)
    tokens_B = torch.empty(B, dtype=torch.int64, device=logits_BV.device)
    logp_B = torch.empty(B, dtype=torch.float32, device=logits_BV.device)
    scan_part, combine = _kernels()
    stride = logits_BV.stride(0)
    scan_part[(B, parts)](
        logits_BV, stride, inv_temp_B, seeds_B, partial, V, per_part, SUB=SUB, num_warps=WARPS
    )
    P = max(2, 1 << (chunks - 1).bit_length())  # a bound on `parts` fixed by V: one compile per vocabulary
    combine[(B,)](logits_BV, stride, inv_temp_B, partial, tokens_B, logp_B, parts, P=P, num_warps=1)
    return tokens_B, logp_B


def draw_seeds(
    B: int, seeded: list[tuple[int, torch.Generator]], shared: torch.Generator | None, device: Any
) -> Tensor:
    """One Philox seed per row for this step: from `shared` (the engine's generator), and for the rows
    of seeded requests from their own generators."""
    seeds_B = torch.randint(0, SEED_MAX, (B,), generator=shared, device=device, dtype=torch.int32)
    for i, gen in seeded:
        seeds_B[i : i + 1].random_(0, SEED_MAX, generator=gen)
    return seeds_B
