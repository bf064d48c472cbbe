"""Batch order: `step` keeps a group in the step that drew it; `completion` sends each finished group to
the oldest started step short of groups, so every step gets exactly its count and a slow group is
trained by a later step."""

from __future__ import annotations

import asyncio

import pytest

from relax.data.sample import Sample
from relax.rewards.scorer import RewardStats
from relax.rollout.step_assembler import StepAssembler


def group(gid: int, reward: float = 1.0) -> list[Sample]:
    return [
        Sample(index=gid, prompt="p", group_id=gid, sample_id=k, prompt_ids=[1], response_ids=[2, 3],
               reward=reward, weight_versions=[0])
        for k in range(2)
    ]  # fmt: skip


def run(order: str, arrivals: list[tuple[int, int]]) -> tuple[StepAssembler, dict[int, list[int]]]:
    """Open steps 1 and 2 (2 groups each); groups arrive as (producer step, group id) in order."""
    written: dict[int, list[int]] = {}

    async def write(step: int, g: list[Sample]) -> None:
        await asyncio.sleep(0)
        written.setdefault(step, []).append(g[0].group_id)

    async def main() -> StepAssembler:
        a = StepAssembler(2, order, write)
        a.open(1)
        a.open(2)
        for origin, gid in arrivals:
            await a.put(origin, group(gid), RewardStats(samples=2))
        return a

    return asyncio.run(main()), written


def test_completion_order_fills_the_oldest_step_first():
    # step 1's second group (11) is slow: step 2's first group finishes before it and trains in step 1
    a, written = run("completion", [(1, 10), (2, 20), (1, 11), (2, 21)])
    assert written == {1: [10, 20], 2: [11, 21]}
    assert a.is_complete(1) and a.is_complete(2)
    m1, m2 = a.collect(1), a.collect(2)
    assert m1["rollout/num_samples"] == m2["rollout/num_samples"] == 4
    assert (m1["rollout/carried_groups"], m2["rollout/carried_groups"]) == (0, 1)
    assert m1["reward/samples"] == 4


def test_step_order_keeps_groups_in_their_step():
    a, written = run("step", [(1, 10), (2, 20), (1, 11), (2, 21)])
    assert written == {1: [10, 11], 2: [20, 21]}
    assert a.is_complete(1) and a.is_complete(2)


def test_a_step_is_complete_only_with_all_its_groups():
    a, _ = run("completion", [(2, 20), (2, 21), (1, 10)])
    assert a.is_complete(1) and not a.is_complete(2)  # step 1 took two of step 2's groups


def test_unknown_order_is_refused():
    with pytest.raises(ValueError, match="batch_order"):
        StepAssembler(2, "fifo", lambda s, g: None)  # type: ignore[arg-type]


def test_over_provisioned_groups_wait_for_the_next_step():
    """`over_provision=2` (want 2): the first producer draws 4 groups and later ones 2. Step 1 takes the
    first two to finish; the other two find every started step full and wait; step 2, when it starts,
    takes them before any group its own producer draws."""
    written: dict[int, list[int]] = {}

    async def write(step: int, g: list[Sample]) -> None:
        await asyncio.sleep(0)
        written.setdefault(step, []).append(g[0].group_id)

    async def main() -> None:
        a = StepAssembler(2, "completion", write, over_provision=2)
        assert [a.quota(), a.quota(), a.quota()] == [4, 2, 2]
        a.open(1)
        targets = [await a.put(1, group(gid), RewardStats(samples=2)) for gid in (10, 11)]
        assert targets == [1, 1] and a.is_complete(1)
        late = [asyncio.ensure_future(a.put(1, group(gid), RewardStats(samples=2))) for gid in (12, 13)]
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in late) and written == {1: [10, 11]}  # no started step has room
        a.collect(1)
        a.open(2)
        assert await asyncio.gather(*late) == [2, 2]
        assert a.is_complete(2) and written[2] == [12, 13]
        assert a.collect(2)["rollout/carried_groups"] == 2  # both drawn by step 1's producer
        a.open(3)
        assert await a.put(3, group(30), RewardStats(samples=2)) == 3  # step 3 has its own room again

    asyncio.run(main())


def test_a_cancelled_waiting_group_gives_its_place_back():
    async def write(step: int, g: list[Sample]) -> None:
        await asyncio.sleep(0)

    async def main() -> None:
        a = StepAssembler(1, "completion", write, over_provision=1)
        a.open(1)
        await a.put(1, group(10), RewardStats(samples=2))
        gone = asyncio.ensure_future(a.put(1, group(11), RewardStats(samples=2)))
        kept = asyncio.ensure_future(a.put(1, group(12), RewardStats(samples=2)))
        await asyncio.sleep(0.01)
        gone.cancel()  # its producer stopped (the run ended, or the rollout restarts)
        await asyncio.sleep(0)
        a.open(2)
        assert await kept == 2 and a.is_complete(2)

    asyncio.run(main())


def test_over_provisioning_needs_completion_order():
    with pytest.raises(ValueError, match="over_provision"):
        StepAssembler(2, "step", lambda s, g: None, over_provision=2)  # type: ignore[arg-type]
