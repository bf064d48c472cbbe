"""A run leaves Ray Serve as it found it: it deletes only the applications it deployed, and shuts Serve
down only when it started it (a cluster's own Serve applications outlive the run)."""

from __future__ import annotations

import pytest

from relax.orchestration import service
from tests.orchestration.role_fixtures import Echo


def _apps() -> set[str]:
    from ray import serve

    return set(serve.status().applications)


@pytest.fixture
def bystander(ray_cluster):
    """An application of someone else's in the cluster's Serve (the session's)."""
    from ray import serve

    handle = serve.run(
        serve.deployment(Echo, ray_actor_options={"num_cpus": 0.1}).bind(),
        name="bystander",
        route_prefix=None,
    )
    yield handle
    serve.delete("bystander")


def test_a_run_in_a_serve_it_did_not_start_leaves_it_and_its_other_applications(bystander):
    assert service.serve_running()
    service.start_serve()
    service.deploy_roles([service.RoleDeployment("echo_role", Echo, num_cpus=0.1)])
    assert {"echo_role", "bystander"} <= _apps()
    service.delete_roles()
    service.shutdown(stop_ray=False)
    assert service.serve_running()
    assert "echo_role" not in _apps()
    assert bystander.ping.remote().result(timeout_s=60) == "pong"


def test_a_run_that_started_serve_shuts_it_down(ray_cluster):
    from ray import serve

    serve.shutdown()  # the session's Serve; started again below for the tests after this one
    try:
        assert not service.serve_running()
        service.start_serve()
        service.start_serve()  # a second attempt of the same run: still the run's Serve
        service.shutdown(stop_ray=False)
        assert not service.serve_running()
    finally:
        serve.start(proxy_location="Disabled")
