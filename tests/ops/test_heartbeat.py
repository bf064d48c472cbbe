"""Heartbeats and what the HealthManager reads from them, on the real board (a Ray actor).

A replica that Serve puts in place of a dead one can take a call before the loop checks the heartbeats
again; the call then fails on the state the new replica lacks. These tests pin the two halves of turning
that into a restartable failure: the new replica is on the board before its constructor returns, and an
error seen while the board shows a replaced role is that role's failure.
"""

from __future__ import annotations

import os
import signal
import time
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


def start_beater(name: str, interval_s: float):
    """A role-like actor that beats as `name` from its constructor, as `with_heartbeat` makes roles do
    (defined here so that Ray ships it by value: workers cannot import a test module)."""
    import ray

    class Beater:
        def __init__(self) -> None:
            self.heartbeat = Heartbeat(name, interval_s).start()

        def pid(self) -> int:
            return os.getpid()

    actor = ray.remote(num_cpus=0)(Beater).remote()
    return actor, ray.get(actor.pid.remote(), timeout=60)


def failures_soon(health: HealthManager) -> dict[str, str]:
    """The first failures the board shows, read every 0.1 s; {} after 50 s, still inside the default
    heartbeat timeout (60 s), so a failure found is the ping's and not the timeout's."""
    deadline = time.monotonic() + 50
    while not (bad := health.failures()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return bad


def test_a_killed_role_fails_before_its_timeout_and_a_late_one_does_not(health):
    """The default `ops.heartbeat_timeout_s` is 60 s: a killed Actor is reported dead by Ray long before,
    as a failure that `check_state` raises; a live role whose beat is late (it beats once a minute) is
    pinged, answers, and is not a failure."""
    import ray

    health.ops = OpsConfig(heartbeat_interval_s=0.2)  # late after 0.4 s
    actor, actor_pid = start_beater("actor", interval_s=0.2)
    fwd, _ = start_beater("actor_fwd", interval_s=60.0)  # alive, but late at every check below
    try:
        health.watch(["actor", "actor_fwd"], timeout_s=30)
        assert health.failures() == {}  # the late one is pinged and answers: not a failure
        os.kill(actor_pid, signal.SIGKILL)
        bad = failures_soon(health)
        assert set(bad) == {"actor"}, bad
        assert "process died" in bad["actor"] and f"pid {actor_pid}" in bad["actor"], bad
        with pytest.raises(GlobalRestart) as raised:
            health.check_state()
        assert raised.value.role == "actor"
    finally:
        for a in (actor, fwd):
            ray.kill(a)


def test_the_board_loads_a_senders_class_only_to_ping_it(health, tmp_path):
    """A handle unpickled loads its actor's class, and a Serve replica's class brings `ray.serve` (most
    of the board's start-up CPU, once per run): the board keeps each handle pickled until a late beat
    makes it ping. The sender's class notes every process that loads it."""
    import ray

    from relax.ops.heartbeat import get_board

    loads = tmp_path / "loads"

    class Noted:
        def __init_subclass__(cls, **kwargs) -> None:  # runs wherever the subclass is unpickled
            super().__init_subclass__(**kwargs)
            with open(loads, "a") as f:
                f.write(f"{os.getpid()}\n")

    class Beater(Noted):
        def __init__(self) -> None:
            self.heartbeat = Heartbeat("actor", 60.0).start()

    health.ops = OpsConfig(heartbeat_interval_s=0.2)  # late after 0.4 s
    actor = ray.remote(num_cpus=0)(Beater).remote()
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=60)
        board_pid = ray.get(get_board().__ray_call__.remote(lambda board: os.getpid()), timeout=30)
        assert str(board_pid) not in loads.read_text().split()  # taken and kept, not unpickled
        time.sleep(0.5)  # the beat is late: the next snapshot pings the sender, so the board loads it
        assert health.failures() == {}
        assert str(board_pid) in loads.read_text().split()
    finally:
        ray.kill(actor)


def test_check_state_leaves_a_dead_stateless_role_to_the_in_place_restart(health):
    import ray

    health.ops = OpsConfig(heartbeat_interval_s=0.2)
    fwd, fwd_pid = start_beater("actor_fwd", interval_s=0.2)
    try:
        health.watch(["actor_fwd"], timeout_s=30)
        os.kill(fwd_pid, signal.SIGKILL)
        assert set(failures_soon(health)) == {"actor_fwd"}
        health.check_state()  # no GlobalRestart: `check` restarts it in place
        assert health.check() == ["actor_fwd"]
        assert health.role_restarts == {"actor_fwd": 1}
    finally:
        ray.kill(fwd)


def test_check_state_does_not_fail_a_wait_when_the_board_is_gone(health):
    """The probe only speeds up what the waits' deadlines and the step's checks find anyway: a board that
    does not answer must not turn every wait of the driver into an error."""
    beat = beat_for("actor")
    try:
        health.watch(["actor"], timeout_s=10)
        close_board()
        health.check_state()  # no exception
    finally:
        beat.stop()
