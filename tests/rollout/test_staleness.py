"""The staleness rule: rollout step s may start only while s - (oldest unconsumed step) <= max_staleness."""

from __future__ import annotations

import asyncio

import pytest

from relax.rollout.staleness import StalenessGate, sample_staleness, staleness_metrics


def test_on_policy_waits_for_the_previous_step():
    gate = StalenessGate(0, first_step=1)
    assert gate.may_start(1)
    assert not gate.may_start(2)  # step 1 not yet trained and pushed


@pytest.mark.parametrize("s", [0, 1, 2, 3])
def test_rollout_never_runs_more_than_max_staleness_ahead(s):
    gate = StalenessGate(s, first_step=1)
    for consumed in range(0, 6):
        if consumed:
            asyncio.run(gate.mark_consumed(consumed))
        allowed = [k for k in range(1, 20) if gate.may_start(k)]
        assert (
            max(allowed) == consumed + 1 + s
        )  # the rule: k + 1 - o <= s with k = step - 1, o = consumed + 1


def test_resume_counts_from_first_step():
    gate = StalenessGate(1, first_step=11)
    assert gate.may_start(12) and not gate.may_start(13)


def test_wait_blocks_until_consumed():
    async def main():
        gate = StalenessGate(1)
        waiter = asyncio.create_task(gate.wait_until_may_start(3))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await gate.mark_consumed(1)
        assert await asyncio.wait_for(waiter, 1) == 1

    asyncio.run(main())


def test_sample_staleness_counts_from_the_oldest_version():
    assert sample_staleness(5, [3, 4]) == 2
    m = staleness_metrics(5, [[5], [4], [3, 4]])
    assert m["staleness/max"] == 2 and m["staleness/mean"] == 1.0
    assert m["staleness/mixed_version_frac"] == pytest.approx(1 / 3)


def test_negative_staleness_is_refused():
    with pytest.raises(ValueError):
        StalenessGate(-1)
