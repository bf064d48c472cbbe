"""Which ready rows a data-plane consumer gets: pure functions over row indexes, shared by every data-plane
implementation (the in-process one calls them directly, TransferQueue through `RelaxTQSampler`).

A sampler takes the ready row indexes (all requested columns written, not yet consumed by this task) in
insertion order and returns the rows to hand out, or `[]` when it cannot serve `batch_size` rows yet
(the caller then waits for more). To add a sampler, write a function with the `Sampler` signature and
register it in `SAMPLERS`.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

# (ready indexes, batch_size, group id per index, length per index, num_ranks) -> chosen indexes
Sampler = Callable[[Sequence[int], int, dict[int, int], dict[int, int], int], list[int]]


def sequential(
    ready: Sequence[int], batch_size: int, groups: dict[int, int], lengths: dict[int, int], num_ranks: int
) -> list[int]:
    """The first `batch_size` ready rows in insertion order."""
    return list(ready[:batch_size]) if len(ready) >= batch_size else []


def whole_groups(
    ready: Sequence[int], batch_size: int, groups: dict[int, int], lengths: dict[int, int], num_ranks: int
) -> list[int]:
    """Whole prompt groups only (GRPO): the earliest groups whose every row is ready, `batch_size` rows.

    A group is complete when all rows written with its group id are ready; `batch_size` must be a
    multiple of the group size. Rows of one group need not be contiguous (unlike TransferQueue's own
    `GRPOGroupNSampler`), so groups finished out of order by the rollout are served as they complete.
    """
    members: dict[int, list[int]] = {}
    for i, g in groups.items():
        members.setdefault(g, []).append(i)
    ready_set = set(ready)
    chosen: list[int] = []
    seen: set[int] = set()
    for i in ready:
        g = groups.get(i, i)
        if g in seen:
            continue
        seen.add(g)
        rows = sorted(members.get(g, [i]))
        if all(r in ready_set for r in rows):
            if len(chosen) + len(rows) > batch_size:
                break
            chosen += rows
        if len(chosen) == batch_size:
            return chosen
    return []


def balance_partitions(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Split positions 0..n-1 into `k` lists with near-equal token sums: longest first onto the lightest
    list (LPT greedy; at most 4/3 of the optimum's largest sum). Each list keeps ascending order."""
    heap = [(0, r) for r in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        load, r = heapq.heappop(heap)
        parts[r].append(i)
        heapq.heappush(heap, (load + lengths[i], r))
    return [sorted(p) for p in parts]


def seqlen_balanced(
    ready: Sequence[int], batch_size: int, groups: dict[int, int], lengths: dict[int, int], num_ranks: int
) -> list[int]:
    """`batch_size` rows (sequential), reordered rank by rank: the rows `balance_partitions` gives rank 0,
    then rank 1's, ...; every rank's share carries about the same number of tokens. `rank_slices`
    recovers the per-rank lists."""
    rows = sequential(ready, batch_size, groups, lengths, num_ranks)
    if not rows or num_ranks <= 1:
        return rows
    parts = balance_partitions([lengths.get(i, 1) for i in rows], num_ranks)
    return [rows[p] for part in parts for p in part]


def rank_slices(rows: Sequence[int], lengths: dict[int, int], num_ranks: int) -> list[list[int]]:
    """The per-rank lists of a `seqlen_balanced` batch (recomputed the same way from the lengths)."""
    parts = balance_partitions([lengths.get(i, 1) for i in rows], num_ranks)
    return [[rows[p] for p in part] for part in parts]


SAMPLERS: dict[str, Sampler] = {
    "sequential": sequential,
    "whole_groups": whole_groups,
    "seqlen_balanced": seqlen_balanced,
}


def get_sampler(name: str) -> Sampler:
    if name not in SAMPLERS:
        raise ValueError(f"unknown data-plane sampler {name!r}; valid: {', '.join(sorted(SAMPLERS))}")
    return SAMPLERS[name]
