"""StepLedger (relax/rollout/ledger.py), the Rollout's account of its steps, on its own: when a step is
ready, which metrics it reports, and the data position a checkpoint records (before the oldest step
whose groups are not all written and trained), in both batch orders. The assembler is a stand-in that
answers what the ledger asks of it."""

from __future__ import annotations

import pytest

from relax.rollout.ledger import StepLedger


class Assembler:
    """The StepAssembler's side the ledger uses: its order, its open steps, completeness, metrics."""

    def __init__(self, order: str) -> None:
        self.order = order
        self.steps: dict[int, str] = {}
        self.complete: set[int] = set()

    def open(self, step: int) -> None:
        self.steps[step] = "open"

    def is_complete(self, step: int) -> bool:
        return step in self.complete

    def collect(self, step: int) -> dict[str, float]:
        self.steps.pop(step)
        return {"rollout/reward_mean": float(step)}


def ledger(order: str) -> StepLedger:
    return StepLedger(Assembler(order))


def pos(step: int) -> dict:
    """The data position recorded when step `step` drew its prompts."""
    return {"index": 10 * step}


def test_step_order_a_step_is_ready_when_its_producer_finished_and_reports_its_metrics():
    led = ledger("step")
    led.open(1, pos(1))
    led.wrote(1, 1)
    assert not led.ready(1)
    led.ahead[1] = 2  # it started two steps ahead of training
    led.finish(1, {"rollout/reward_mean": 0.5})
    assert led.ready(1)
    assert led.collect(1) == {"rollout/reward_mean": 0.5, "staleness/rollout_ahead": 2.0}
    assert 1 not in led.assembler.steps and 1 not in led.produced
    assert not led.ready(1)  # collected: nothing is left to train on


def test_completion_order_ready_follows_the_assembler_and_metrics_carry_the_latest_producers_ds_figures():
    led = ledger("completion")
    for step in (1, 2, 3):
        led.open(step, pos(step))
    led.finish(1, {"rollout/ds_kept": 1.0, "rollout/reward_mean": 9.0})
    led.finish(2, {"rollout/ds_kept": 2.0})
    led.finish(3, {"rollout/ds_kept": 3.0})
    assert not led.ready(2)
    led.assembler.complete.add(2)
    assert led.ready(2)
    metrics = led.collect(2, {"rollout/extra": 7.0})
    # the assembler's metrics of the groups step 2 trains on, the ds figures of producer 2 (the latest
    # finished one not after step 2; producer 1's reward is not the step's), the extra, no ahead count
    assert metrics == {
        "rollout/reward_mean": 2.0,
        "rollout/ds_kept": 2.0,
        "rollout/extra": 7.0,
        "staleness/rollout_ahead": 0.0,
    }
    assert list(led.produced) == [3]  # producers up to step 2 are reported once


def test_the_data_position_is_before_the_oldest_step_not_wholly_trained():
    led = ledger("completion")
    for step in (1, 2, 3):
        led.open(step, pos(step))
    led.wrote(1, 1)
    led.wrote(2, 2)
    led.wrote(2, 3)  # one of step 2's groups went to step 3
    led.wrote(3, 3)
    for step in (1, 2, 3):
        led.finish(step, {})
    assert led.data_position({"index": 99}) == pos(1)
    led.mark_trained(1)
    assert led.trained == 1 and 1 not in led.source_states  # wholly trained: forgotten
    assert led.data_position({"index": 99}) == pos(2)
    led.mark_trained(2)  # step 2's group in step 3 is not trained yet: its prompts are drawn again
    assert led.data_position({"index": 99}) == pos(2)
    assert not led.settled(2)
    led.mark_trained(3)
    assert led.source_states == {} and led.targets == {} and led.finished == set()
    assert led.data_position({"index": 99}) == {"index": 99}  # nothing pending: the current position


def test_a_step_whose_producer_has_not_finished_is_never_settled():
    led = ledger("step")
    led.open(1, pos(1))
    led.open(2, pos(2))
    led.wrote(1, 1)
    led.finish(1, {})
    led.wrote(2, 2)  # step 2's producer is still drawing
    led.mark_trained(5)
    assert 1 not in led.source_states  # finished and trained: forgotten
    assert not led.settled(2)
    assert led.data_position({"index": 99}) == pos(2)  # a resume draws step 2's prompts again


def test_a_producer_with_no_group_written_yet_counts_as_its_own_step():
    led = ledger("step")
    led.open(4, pos(4))
    led.finish(4, {})
    assert not led.settled(4)  # nothing trained yet
    led.mark_trained(3)
    assert led.data_position({"index": 99}) == pos(4)
    led.mark_trained(4)
    assert led.data_position({"index": 99}) == {"index": 99}


def test_collecting_a_step_never_finished_in_step_order_is_an_error():
    led = ledger("step")
    led.open(1, pos(1))
    with pytest.raises(KeyError):
        led.collect(1)
