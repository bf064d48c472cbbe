"""The run's start-up waits (relax/orchestration/deployment.py): the data plane starts on a daemon thread that a stop does not wait
for, and a plane that comes after the stop is closed, not left running."""

from __future__ import annotations

import threading

import pytest

from relax.orchestration.deployment import _Background
from relax.orchestration.service import RunStopped


def test_a_stop_gives_up_on_the_wait_and_the_late_value_is_closed():
    release, done, closed = threading.Event(), threading.Event(), []

    def slow() -> str:
        release.wait(60)
        return "plane"

    def close(value: str) -> None:
        closed.append(value)
        done.set()

    job = _Background(slow)
    looks = []

    def check() -> None:  # the second look at the stop flag finds it set
        looks.append(1)
        if len(looks) > 1:
            raise RunStopped("stop requested")

    with pytest.raises(RunStopped):
        job.result(check, close)
    assert closed == []  # not there yet
    release.set()
    assert done.wait(30)  # the worker thread closes it once it returns
    assert closed == ["plane"]


def test_the_value_and_the_error_reach_the_waiting_thread():
    assert _Background(lambda: 3).result(lambda: None, lambda v: None) == 3

    def fails() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        _Background(fails).result(lambda: None, lambda v: None)


def test_abandoning_a_finished_job_closes_its_value_at_once():
    closed = []
    job = _Background(lambda: "plane")
    job._finished.wait(10)
    job.abandon(closed.append)
    assert closed == ["plane"]
