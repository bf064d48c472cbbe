"""Heartbeats and what the HealthManager reads from them, on the real board (a Ray actor).

A replica that Serve puts in place of a dead one can take a call before the loop checks the heartbeats
again; the call then fails on the state the new replica lacks. These tests pin the two halves of turning
that into a restartable failure: the new replica is on the board before its constructor returns, and an
error seen while the board shows a replaced role is that role's failure.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from relax.config import OpsConfig
from relax.ops.heartbeat import Heartbeat, close_board
from relax.ops.notify import Notifier
from relax.orchestration.health import GlobalRestart, HealthManager


@pytest.fixture
def health(ray_cluster):
    manager = HealthManager(SimpleNamespace(ops=OpsConfig()), Notifier([], "test"))
    yield manager
    close_board()


def beat_for(name: str) -> Heartbeat:
    return Heartbeat(name, interval_s=60.0).start()  # beats again only a minute later


def test_the_first_beat_is_on_the_board_when_start_returns(health):
    beat = beat_for("actor")
    try:
        snap = health._snapshot()  # noqa: SLF001 - the board as the loop reads it
        assert snap["actor"]["incarnation"] == beat.incarnation
        assert snap["actor"]["pid"] == os.getpid()
    finally:
        beat.stop()


def test_an_error_while_a_role_was_replaced_is_that_roles_restartable_failure(health):
    first = beat_for("actor")
    reference = beat_for("reference")
    health.watch(["actor", "reference"], timeout_s=10)
    error = RuntimeError("WeightPublisher.publish before connect(): no engines to publish to")
    assert health.failure_behind(error) is None  # every role is the one we initialised: a plain error

    replacement = beat_for("actor")  # Serve's new replica, constructed before it takes the call
    second_stage = beat_for("reference")
    try:
        failure = health.failure_behind(error)
        assert isinstance(failure, GlobalRestart)
        assert failure.role == "actor"  # the role with training state, not the stateless one
        assert "replaced" in failure.reason and "publish before connect" in failure.reason
        assert health.failure_behind(failure) is None  # already a restart: raised as it is
    finally:
        for beat in (first, reference, replacement, second_stage):
            beat.stop()


def test_without_watched_roles_an_error_stands(health):
    assert health.failure_behind(ValueError("bad row")) is None
