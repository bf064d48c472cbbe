"""The HealthManager decides and counts; the caller restarts. `check` names the failed stateless roles
to restart in place, each counted once, and raises `GlobalRestart` before counting anything when a
failed role holds training state or is past its restart budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relax.ops.notify import Notifier
from relax.orchestration.health import GlobalRestart, HealthManager


class Health(HealthManager):
    """The real decisions over a given snapshot of the heartbeat board (no Ray here)."""

    def __init__(self, snap: dict, max_role_restarts: int = 2) -> None:
        self.ops = SimpleNamespace(max_role_restarts=max_role_restarts, heartbeat_timeout_s=30.0)
        self.notifier = Notifier([], "test")
        self.known, self.role_restarts, self.engine_restarts = {}, {}, 0
        self.snap = snap

    def _snapshot(self, asked=None) -> dict:
        return self.snap


def beat(incarnation: str, age_s: float = 0.0) -> dict:
    return {"incarnation": incarnation, "age_s": age_s}


def test_failed_stateless_roles_are_named_and_counted():
    health = Health({"reference": beat("new"), "metrics": beat("m", age_s=99.0), "actor": beat("a")})
    health.known = {"reference": "old", "metrics": "m", "actor": "a"}
    assert sorted(health.check()) == ["metrics", "reference"]
    assert health.role_restarts == {"reference": 1, "metrics": 1}
    assert health.metrics()["health/role_restarts"] == 2.0


def test_a_failed_role_with_training_state_raises_before_anything_is_counted():
    health = Health({"reference": beat("new")})  # the Actor's heartbeat is gone
    health.known = {"reference": "old", "actor": "a"}
    with pytest.raises(GlobalRestart, match="'actor'"):
        health.check()
    assert health.role_restarts == {}


def test_a_role_past_its_budget_raises():
    health = Health({}, max_role_restarts=1)
    health.failed("advantages", "its loop failed")
    assert health.role_restarts == {"advantages": 1}
    with pytest.raises(GlobalRestart, match="failed 2 times"):
        health.failed("advantages", "its loop failed")
    assert health.role_restarts == {"advantages": 1}
