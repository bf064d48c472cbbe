"""How many tokens the engine's KV pool may grow to (`max_total_tokens`) when no number is given.

The pool grows by doubling as tokens arrive (`paged_kv_cache.py`), so the budget is a ceiling, not an
allocation: an engine holds only what its busiest moment needed. Past the ceiling the scheduler preempts
rows (`kv_blocks.py`), which costs a recompute each. A fixed ceiling sized for short responses made long
ones preempt: 256 rows of 2,048-token responses hold ~540k tokens, twice the old fixed 262,144, so half
the batch waited and was recomputed, and an RL step's rollout ran at about half the engine's throughput
on the same work (docs/engines.md). So on a GPU the ceiling is a share of the device's memory, as
SGLang's `--mem-fraction-static` sizes its pool, and on the CPU (tiny models, host memory shared with the
trainer) the old fixed number.

`kv_memory_fraction` defaults to a quarter of the GPU: in colocate the engine shares its GPU with a
training rank, whose micro-batches are planned from the memory left when it first runs (after the first
rollout has grown the pool, `relax/backends/training/memory.py`).
"""

from __future__ import annotations

import torch

CPU_MAX_TOTAL_TOKENS = 1 << 18  # the CPU's ceiling (262,144 tokens)
KV_MEMORY_FRACTION = 0.25  # of the GPU's memory, the default ceiling on a GPU


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def default_max_total_tokens(
    device: torch.device, bytes_per_token: int, kv_memory_fraction: float = KV_MEMORY_FRACTION
) -> int:
    """The pool's ceiling in tokens: `kv_memory_fraction` of the GPU's memory, or the CPU's fixed number."""
    if not 0 < kv_memory_fraction <= 0.95:
        raise ValueError(f"kv_memory_fraction={kv_memory_fraction} must be in (0, 0.95]")
    if device.type != "cuda":
        return CPU_MAX_TOTAL_TOKENS
    total = torch.cuda.get_device_properties(device).total_memory
    return max(int(total * kv_memory_fraction) // bytes_per_token, 1024)
