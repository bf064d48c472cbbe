"""A driver wait that ends without its result cancels the call. Serve queues a call to a dead replica and
delivers it to whatever replica later serves the same application name, so a call left queued when a
global restart tears the roles down would reach the restarted Actor as a second update of a step the new
attempt makes itself (it then waits forever for rows the first took). The fault suite's Actor-kill run
(tests/ops/test_faults_e2e.py) is the end-to-end case; these pin the cancels, with stand-in responses."""

from __future__ import annotations

import pytest

from relax.orchestration.health import GlobalRestart
from relax.orchestration.step_flow import StepFlow
from relax.orchestration.stop import StopRequest
from relax.orchestration.watchdog import Watchdog


class Queued:
    """A Serve response that never arrives (its replica is dead); records its cancel."""

    def __init__(self) -> None:
        self.cancelled = False

    def result(self, timeout_s: float | None = None):
        raise TimeoutError

    def cancel(self) -> None:
        self.cancelled = True


def lost_actor() -> None:
    raise GlobalRestart("actor", "its process died")


def test_a_wait_the_probe_ends_cancels_its_call():
    queued = Queued()
    dog = Watchdog(step_timeout_s=None, stop_grace_s=60.0, stop=StopRequest(), probe=lost_actor)
    with pytest.raises(GlobalRestart, match="process died"):
        dog.wait(queued, "actor", "the weight push")
    assert queued.cancelled


def test_a_wait_past_its_deadline_cancels_its_call():
    queued = Queued()
    dog = Watchdog(step_timeout_s=0.0, stop_grace_s=60.0, stop=StopRequest())
    with pytest.raises(RuntimeError, match="stalled"):
        dog.wait(queued, "rollout", "the rollout")
    assert queued.cancelled


class Method:
    def __init__(self, response) -> None:
        self.response = response

    def remote(self, *args):
        return self.response


class Health:
    """The HealthManager's side of a check that finds the Actor dead."""

    def ask(self):
        return None

    def check(self, asked=None):
        lost_actor()

    def watch_engines(self, repair) -> None:
        pass

    def unwatch_engines(self) -> None:
        pass


def test_an_update_whose_wait_finds_the_actor_dead_is_cancelled(monkeypatch):
    queued = Queued()
    actor = type("Actor", (), {"train": Method(queued)})()
    monkeypatch.setattr("relax.orchestration.step_flow.POLL_S", 0.01)
    f = StepFlow("colocate", {"rollout": object(), "actor": actor}, Health())
    with pytest.raises(GlobalRestart):
        f.train(3)
    assert queued.cancelled
