"""StepProducer hands finished groups to the sink concurrently: a group that finishes while an earlier
group's write is in flight does not wait for that write, `produce` returns only after every write has
landed, and a failed write fails the step (the other writes are cancelled)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from relax.config import RelaxConfig
from relax.data.sample import Sample
from relax.rewards.scorer import RewardStats
from relax.rollout.step_producer import StepProducer

GROUPS = 4


def config(**algorithm) -> RelaxConfig:
    return RelaxConfig(
        model={"path": "unused"},
        data={"train_files": ["unused.jsonl"]},
        rollout={"prompts_per_step": GROUPS, "n_samples_per_prompt": 2},
        algorithm=algorithm,
    )


class FakeLoop:
    """Group `g` finishes after g * 10 ms; rewards differ within a group unless `flat` lists it."""

    def __init__(self, flat: frozenset[int] = frozenset()) -> None:
        self.flat = flat
        self.tokenizer = SimpleNamespace(decode=lambda ids, **kw: "x")
        self.scorer = SimpleNamespace(score=self._score)
        self.inflight = SimpleNamespace(num_aborted=0)

    def sampling_params(self) -> dict:
        return {}

    async def _generate_group(self, row: int, group_id: int, params: dict) -> list[Sample]:
        await asyncio.sleep(0.01 * (row % 100))
        rewards = [1.0, 1.0] if row in self.flat else [0.0, 1.0]
        return [
            Sample(index=row, prompt="p", group_id=group_id, sample_id=k, prompt_ids=[1],
                   response_ids=[2], response_text="x", reward=r, weight_versions=[0])
            for k, r in enumerate(rewards)
        ]  # fmt: skip

    async def _score(self, samples: list[Sample]) -> RewardStats:
        return RewardStats(samples=len(samples))

    def after_scoring(self, samples: list[Sample]) -> None:
        pass


class Rows:
    def __init__(self) -> None:
        self.next = 1

    def next_batch(self, n: int) -> list[int]:
        rows = list(range(self.next, self.next + n))
        self.next += n
        return rows


def test_groups_are_written_concurrently_and_all_land_before_the_step_ends():
    release = asyncio.Event()
    started: list[int] = []
    landed: list[int] = []

    async def sink(group: list[Sample], stats: object) -> None:
        started.append(group[0].index)
        if group[0].index == 1:  # the first write stalls until every other group has started its own
            await release.wait()
        elif len(started) == GROUPS:
            release.set()
        landed.append(group[0].index)

    async def main() -> dict[str, float]:
        producer = StepProducer(config(), FakeLoop(), Rows())
        return await asyncio.wait_for(producer.produce(1, sink), timeout=10)

    metrics = asyncio.run(main())
    assert started == [1, 2, 3, 4]
    assert sorted(landed) == [1, 2, 3, 4] and landed[-1] == 1  # produce waited for the stalled write
    assert metrics["rollout/num_samples"] == 2 * GROUPS


def test_a_failed_write_fails_the_step_and_cancels_the_others():
    cancelled: list[int] = []

    async def sink(group: list[Sample], stats: object) -> None:
        row = group[0].index
        if row == 2:
            raise OSError("data plane unreachable")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(row)
            raise

    async def main() -> None:
        producer = StepProducer(config(), FakeLoop(), Rows())
        await asyncio.wait_for(producer.produce(1, sink), timeout=10)

    with pytest.raises(OSError, match="unreachable"):
        asyncio.run(main())
    assert cancelled == [1]  # groups 3 and 4 were still generating: their generation was cancelled


def test_dynamic_sampling_still_writes_exactly_the_step_count():
    written: list[int] = []

    async def sink(group: list[Sample], stats: object) -> None:
        await asyncio.sleep(0.005)
        written.append(group[0].index)

    async def main() -> dict[str, float]:
        # rows 1 and 3 of the first round are uninformative: a second round draws rows 5 and 6
        loop = FakeLoop(flat=frozenset({1, 3}))
        producer = StepProducer(config(dynamic_sampling=True, dynamic_sampling_max_rounds=2), loop, Rows())
        return await producer.produce(1, sink)

    metrics = asyncio.run(main())
    assert sorted(written) == [2, 4, 5, 6]
    assert metrics["rollout/ds_rounds"] == 2.0
