"""The reward pool: Ray worker processes under one concurrency limit, whole groups, and failures,
timeouts and dead workers turned into fallback rewards that are counted with the samples' ids."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from relax.data.sample import Sample
from relax.rewards import RewardConfig, build_scorer
from relax.rewards.pool import PooledRewardScorer, split_by_group

FNS = "tests.rewards.pool_fns"


@pytest.fixture(autouse=True)
def _repo_root_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2]))


def batch(n_groups: int, group_size: int) -> list[Sample]:
    return [
        Sample(index=g, prompt="3+4=", label="7", response_text="7", group_id=g, sample_id=k)
        for g in range(n_groups)
        for k in range(group_size)
    ]


def pool(name: str, **cfg: object) -> PooledRewardScorer:
    scorer = build_scorer(RewardConfig(name=f"{FNS}:{name}", **cfg))
    assert isinstance(scorer, PooledRewardScorer)
    return scorer


def peak_overlap(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(t0, 1) for t0, _ in intervals] + [(t1, -1) for _, t1 in intervals])
    now = peak = 0
    for _, step in events:  # at equal times an end (-1) sorts before a start
        now += step
        peak = max(peak, now)
    return peak


def test_split_keeps_groups_whole_and_balances() -> None:
    samples = batch(5, 2)[:-1] + [Sample(index=9, prompt="", group_id=7)]  # sizes 2,2,2,2,1,1
    chunks = split_by_group(samples, 2)
    assert sorted(len(c) for c in chunks) == [5, 5]
    for chunk in chunks:
        groups = {samples[i].group_id for i in chunk}
        assert all(samples[i].group_id in groups for i in range(len(samples)) if i in chunk)
        for g in groups:  # every member of a group is in the chunk holding it
            assert {i for i, s in enumerate(samples) if s.group_id == g} <= set(chunk)
    assert split_by_group(samples[:1], 4) == [[0]]


def test_in_process_scorer_records_failed_ids_and_info_means() -> None:
    scorer = build_scorer(RewardConfig(name=f"{FNS}:group_size", fallback_reward=-1.0))
    samples = batch(2, 3)
    stats = scorer.score_sync(samples)
    assert stats.failed == [] and stats.as_metrics()["reward/info/pid"] > 0
    flaky = build_scorer(RewardConfig(name=f"{FNS}:fails_on_odd", fallback_reward=-1.0))
    stats = flaky.score_sync(samples)
    assert stats.failed == ["1/0", "1/1", "1/2"] and [s.reward for s in samples] == [1.0] * 3 + [-1.0] * 3


def test_pool_respects_the_concurrency_limit(ray_cluster) -> None:
    scorer = pool("stamped", num_workers=2, max_concurrency=4, kwargs={"sleep_s": 0.3})
    try:
        samples = batch(16, 1)
        stats = asyncio.run(scorer.score(samples))
        assert [s.reward for s in samples] == [1.0] * 16 and stats.samples == 16 and stats.calls == 16
        peak = peak_overlap([(s.reward_info["t0"], s.reward_info["t1"]) for s in samples])
        assert peak <= 4 and peak >= 3  # two workers, two calls each at once
        assert len({s.reward_info["pid"] for s in samples}) == 2  # the work ran in both workers
        assert stats.as_metrics()["reward/info/pid"] > 0  # reward_info is logged as means
    finally:
        scorer.close()


def test_pool_group_rewards_see_whole_groups(ray_cluster) -> None:
    scorer = pool("group_size", num_workers=3)
    try:
        samples = batch(5, 4)
        stats = asyncio.run(scorer.score(samples))
        assert [s.reward for s in samples] == [4.0] * 20
        assert stats.calls == 5 and stats.counts == {f"{FNS}:group_size": 20}
        for g in range(5):  # each group was scored in one process
            assert len({s.reward_info["pid"] for s in samples if s.group_id == g}) == 1
    finally:
        scorer.close()


def test_pool_counts_failures_and_timeouts_with_sample_ids(ray_cluster, caplog) -> None:
    failing = pool("fails_on_odd", num_workers=2, fallback_reward=-1.0)
    hanging = pool("hangs_on_odd", num_workers=2, timeout_s=0.5)
    try:
        samples = batch(4, 2)
        with caplog.at_level(logging.WARNING, logger="relax.rewards.pool"):
            stats = asyncio.run(failing.score(samples))
        assert [s.reward for s in samples] == [1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0]
        assert stats.failures == 4 and stats.timeouts == 0
        assert sorted(stats.failed) == ["1/0", "1/1", "3/0", "3/1"]  # index/sample_id
        assert stats.as_metrics()["reward/failures"] == 4.0
        assert any("1/0" in r.getMessage() and "3/1" in r.getMessage() for r in caplog.records)

        samples = batch(4, 1)
        stats = asyncio.run(hanging.score(samples))
        assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
        assert stats.timeouts == 2 and stats.failures == 0 and sorted(stats.failed) == ["1/0", "3/0"]
    finally:
        failing.close()
        hanging.close()


def test_pool_survives_a_dead_worker(ray_cluster) -> None:
    scorer = pool("crashes_on_index_3", num_workers=2, fallback_reward=-1.0)
    try:
        samples = batch(6, 1)
        stats = asyncio.run(scorer.score(samples))
        failed = [s for s in samples if s.reward == -1.0]
        assert 3 in {s.index for s in failed}  # the dead worker's whole chunk got the fallback
        assert stats.failures == len(failed) and sorted(stats.failed) == sorted(
            f"{s.index}/0" for s in failed
        )
        assert all(s.reward == 1.0 for s in samples if s not in failed)
        again = [s for s in batch(6, 1) if s.index != 3]
        asyncio.run(scorer.score(again))  # the worker was restarted
        assert [s.reward for s in again] == [1.0] * 5
    finally:
        scorer.close()
