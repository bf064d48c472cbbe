"""Sampling on CUDA in two Triton kernels, for the common RL batch: every row sampled at its own
temperature > 0, no top-k / top-p / min-p. The draw is the inverse CDF of softmax(x_b / T_b):

    scan_part  program (row, part) reads its part's 4 x SUB logits once: the part's maximum and its sum
               of exp(x / T - maximum), with one rescale per four entries a lane
    combine    program row: the log-sum-exp over the parts; one uniform u from Philox keyed by the row's
               seed; the part in which the cumulative mass first exceeds u * total; then that part alone,
               in order, to the first token whose cumulative mass exceeds it (`tl.cumsum`)

and writes the token and its log-prob x_b[token] / T_b - lse_b. A part is always one chunk of 4 x SUB
entries, whatever the batch, so a row's sums (and so its draw) depend only on its logits and its seed:
`BatchSampler` draws the seeds of a step from the engine's generator, a seeded request's from its own
(the same tokens whatever else is batched). Rounding can leave u * total just past the mass that the
second kernel recomputes: the draw then stops at the part's last token of nonzero probability, never on
a banned one.

An earlier version drew Gumbel-max in one pass (an argmax of x / T - log(-log(U)) with a Philox uniform
per entry). Its two logarithms and the random numbers per entry made it compute-bound (docs/
measurements.md). This one spends about one exponential per entry
(`python benchmarks/sampler.py --device cuda --rows 256 --vocab 151936` times it against the torch
paths). Without Triton or CUDA, `available()` is False and the torch path runs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

SUB = 1024  # lanes of a scan program; it reads 4 x SUB vocabulary entries, one part
WARPS = 4
SCAN_SUB = 1024  # entries per step of the in-part search
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
    def scan_part(logits_ptr, stride, inv_temp_ptr, part_ptr, V, SUB: tl.constexpr):
        """Program (row, part): entries [part * 4 * SUB, (part + 1) * 4 * SUB). Writes the part's max
        and sum of exp(x - max) at part_ptr[row, part, :] (float32)."""
        row, part, parts = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
        base = logits_ptr + row.to(tl.int64) * stride
        inv_t = tl.load(inv_temp_ptr + row)
        offs = part * 4 * SUB + tl.arange(0, SUB)
        x0 = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_t
        x1 = tl.load(base + offs + SUB, mask=offs + SUB < V, other=float("-inf")).to(tl.float32) * inv_t
        x2 = (
            tl.load(base + offs + 2 * SUB, mask=offs + 2 * SUB < V, other=float("-inf")).to(tl.float32)
            * inv_t
        )
        x3 = (
            tl.load(base + offs + 3 * SUB, mask=offs + 3 * SUB < V, other=float("-inf")).to(tl.float32)
            * inv_t
        )
        top = tl.max(tl.maximum(tl.maximum(x0, x1), tl.maximum(x2, x3)), 0)
        shift = tl.where(top == float("-inf"), 0.0, top)  # a part of padding only
        total = tl.sum(tl.exp(x0 - shift) + tl.exp(x1 - shift) + tl.exp(x2 - shift) + tl.exp(x3 - shift), 0)
        out = part_ptr + (row * parts + part) * 2
        tl.store(out, top)
        tl.store(out + 1, total)

    @triton.jit(do_not_specialize=["parts"])
    def combine(
        logits_ptr,
        stride,
        inv_temp_ptr,
        seed_ptr,
        part_ptr,
        token_ptr,
        logp_ptr,
        V,
        parts,
        P: tl.constexpr,
        PART: tl.constexpr,
        STEP: tl.constexpr,
    ):
        """Program row: log-sum-exp, the inverse-CDF draw over the parts and then within one part."""
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        inv_t = tl.load(inv_temp_ptr + row)
        k = tl.arange(0, P)
        inside = k < parts
        part = part_ptr + (row * parts + k) * 2
        pmax = tl.load(part, mask=inside, other=float("-inf"))
        psum = tl.load(part + 1, mask=inside, other=0.0)
        top = tl.max(pmax, 0)
        mass = tl.where(pmax == float("-inf"), 0.0, psum * tl.exp(pmax - top))  # in units of exp(top)
        total = tl.sum(mass, 0)
        lse = top + tl.log(total)
        two = tl.arange(0, 2)
        u = tl.min(tl.where(two == 0, tl.rand(tl.load(seed_ptr + row), two), 2.0), 0)
        target = u * total
        before_K = tl.cumsum(mass, 0) - mass
        last_kept = tl.max(tl.where(mass > 0, k, 0), 0)
        chosen = tl.min(tl.where((before_K + mass > target) & (mass > 0), k, last_kept), 0)
        target = tl.maximum(target - tl.sum(tl.where(k == chosen, before_K, 0.0), 0), 0.0)
        lanes = tl.arange(0, STEP)
        start = chosen * PART
        end = tl.minimum(start + PART, V)
        run = 0.0
        token = -1
        last_pos = start
        while (token < 0) & (start < end):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < end, other=float("-inf")).to(tl.float32) * inv_t
            e = tl.exp(x - top)
            cum = tl.cumsum(e, 0) + run
            hit = tl.min(tl.where((cum > target) & (e > 0), offs, V), 0)
            token = tl.where(hit < V, hit, -1)
            last_pos = tl.maximum(last_pos, tl.max(tl.where(e > 0, offs, 0), 0))
            run = run + tl.sum(e, 0)
            start += STEP
        token = tl.where(token < 0, last_pos, token)
        x_tok = tl.load(base + token).to(tl.float32) * inv_t
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logp_ptr + row, x_tok - lse)

    return scan_part, combine


def fused_sample(logits_BV: Tensor, inv_temp_B: Tensor, seeds_B: Tensor) -> tuple[Tensor, Tensor]:
    """Token ids [B] (int64) and their log-probs [B] (float32) of one draw per row from
    softmax(logits / T); `inv_temp_B` holds 1 / T (float32), `seeds_B` the rows' Philox seeds (int32).
    A program per part of 4 x SUB entries keeps every SM busy at any batch size (a row of 151936 entries
    is 38 parts)."""
    B, V = logits_BV.shape
    if logits_BV.stride(1) != 1:
        logits_BV = logits_BV.contiguous()
    parts = -(-V // (4 * SUB))
    partial = torch.empty(B, parts, 2, dtype=torch.float32, device=logits_BV.device)
    tokens_B = torch.empty(B, dtype=torch.int64, device=logits_BV.device)
    logp_B = torch.empty(B, dtype=torch.float32, device=logits_BV.device)
    scan_part, combine = _kernels()
    stride = logits_BV.stride(0)
    scan_part[(B, parts)](logits_BV, stride, inv_temp_B, partial, V, SUB=SUB, num_warps=WARPS)
    P = max(2, 1 << (parts - 1).bit_length())
    combine[(B,)](
        logits_BV, stride, inv_temp_B, seeds_B, partial, tokens_B, logp_B, V, parts,
        P=P, PART=4 * SUB, STEP=SCAN_SUB, num_warps=4,
    )  # fmt: skip
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
