"""A role whose constructor raises stops the deployment at once with its error and node, instead of Serve
retrying it for as long as the run lives; a stop requested while roles start ends the start."""

from __future__ import annotations

import time

import pytest

from relax.orchestration import service
from tests.orchestration.role_fixtures import Broken, Slow


@pytest.fixture
def serve_session(ray_cluster):
    service.start_serve()
    yield
    from ray import serve

    for name in ("broken", "slow"):
        try:  # not waited for: Serve kills "slow" in its constructor only after the graceful timeout
            serve.delete(name, _blocking=False)
        except Exception:  # noqa: BLE001 - not deployed
            pass


def test_a_failing_constructor_stops_the_deployment_with_its_error_and_node(serve_session):
    polls = []

    def should_stop() -> bool:  # called once per poll of the deployment's status (every 0.2 s)
        polls.append(1)
        return False

    with pytest.raises(service.RoleStartError) as e:
        service.deploy_roles(
            [service.RoleDeployment("broken", Broken, ("/nowhere",), num_cpus=0.1)], should_stop=should_stop
        )
    # at the constructor's first report: not after Serve's retries, nor at the deploy timeout (3000 polls)
    assert len(polls) < 150, len(polls)
    assert e.value.role == "broken" and e.value.node == "127.0.0.1"
    assert "FileNotFoundError: no model folder at /nowhere" in str(e.value)


def test_a_stop_while_roles_start_ends_the_start(serve_session):
    asked = time.monotonic() + 2
    with pytest.raises(service.RunStopped, match="slow"):
        service.deploy_roles(
            [service.RoleDeployment("slow", Slow, num_cpus=0.1)], should_stop=lambda: time.monotonic() > asked
        )


def test_the_cluster_to_join_comes_from_the_config_or_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert service.cluster_address(None) is None
    assert service.cluster_address("auto") == "auto"
    monkeypatch.setenv("RAY_ADDRESS", "198.18.0.1:6379")
    assert service.cluster_address(None) == "198.18.0.1:6379"
    assert service.cluster_address("10.0.0.1:6379") == "10.0.0.1:6379"
