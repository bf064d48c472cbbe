"""Data-plane samplers: sequential, whole groups, sequence-length balanced across ranks."""

from __future__ import annotations

from relax.dataplane.samplers import (
    balance_partitions,
    rank_slices,
    seqlen_balanced,
    sequential,
    whole_groups,
)


def test_sequential_needs_a_full_batch():
    assert sequential([3, 1, 2], 2, {}, {}, 1) == [3, 1]
    assert sequential([3], 2, {}, {}, 1) == []


def test_whole_groups_waits_for_every_member():
    groups = {0: 7, 1: 7, 2: 8, 3: 8}
    assert whole_groups([0, 2, 3], 2, groups, {}, 1) == [2, 3]  # group 7 lacks row 1
    assert whole_groups([0, 2], 2, groups, {}, 1) == []
    assert whole_groups([2, 3, 0, 1], 4, groups, {}, 1) == [2, 3, 0, 1]


def test_balance_partitions_lpt():
    parts = balance_partitions([8, 7, 6, 5, 4], 2)
    sums = sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts)
    assert sums == [13, 17]  # LPT: 8->A, 7->B, 6->B (13), 5->A (13), 4->A (17)
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3, 4]


def test_seqlen_balanced_splits_tokens_evenly_across_ranks():
    lengths = {0: 100, 1: 10, 2: 90, 3: 20}
    rows = seqlen_balanced([0, 1, 2, 3], 4, {}, lengths, 2)
    per_rank = rank_slices(rows, lengths, 2)
    assert [sum(lengths[i] for i in r) for r in per_rank] == [110, 110]
