"""Starting and stopping the Ray cluster, Ray Serve, and one Serve application per role.

Each role is its own Serve application, so a failed replica is restarted by Serve without touching the
other roles. Role classes are plain Python classes; `deploy_role` wraps them with `serve.deployment`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Loopback-only, no auth on dev machines; the user's own environment wins.
RAY_ENV_DEFAULTS = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def set_ray_env_defaults() -> None:
    """Set before Ray starts, so every worker it spawns inherits them."""
    for k, v in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)
    # Serve replicas export their cached request metrics every 100 ms by default, a steady cost per idle
    # replica on a small host (docs/measurements.md). Relax's own metrics do not come from there.
    os.environ.setdefault("RAY_SERVE_METRICS_EXPORT_INTERVAL_MS", "1000")
    # Serve's controller runs its control loop every 100 ms by default, which costs CPU with nothing to do
    # (docs/measurements.md). The cost of 0.5 s: a deploy or a replica replacement may start up to 0.4 s
    # later. The test suite, which deploys hundreds of roles, keeps Serve's 0.1 s (tests/conftest.py).
    os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
    # TransferQueue asks for 8 torch threads per put/get and logs a warning on every call when the host
    # has fewer physical cores; ask for what is there.
    try:
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        cores = os.cpu_count() or 1
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, cores)))


def start_ray(address: str | None, num_cpus: int, object_store_mb: int, num_gpus: int | None = None) -> bool:
    """Join `address`, or start a local single-node Ray bound to 127.0.0.1. Returns whether this call
    connected (False when Ray was already initialised in this process, e.g. by a test session)."""
    set_ray_env_defaults()
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            object_store_memory=object_store_mb * 1024 * 1024,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
        )
    logger.info("ray resources: %s", ray.cluster_resources())
    return True


def start_serve() -> None:
    from ray import serve

    serve.start(proxy_location="Disabled")


def _application(
    name: str,
    cls: type,
    args: tuple,
    kwargs: dict[str, Any],
    num_cpus: float,
    num_gpus: float,
    max_ongoing_requests: int,
    heartbeat_s: float | None,
    cpus: str | None = None,
):
    from ray import serve

    from relax.utils.cpu_affinity import with_cpu_affinity
    from relax.utils.gc_freeze import with_frozen_startup

    cls = with_cpu_affinity(cls, cpus, f"CPU budget of role {name}")  # before the role starts threads
    cls = with_frozen_startup(cls)  # a replica is its own process: keep the collector off its start-up
    if heartbeat_s is not None:
        from relax.ops.heartbeat import with_heartbeat

        cls = with_heartbeat(cls, name, heartbeat_s)
    deployment = serve.deployment(
        cls,
        name=name,
        num_replicas=1,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=20,
    )
    return deployment.bind(*args, **kwargs)


def deploy_role(
    name: str,
    cls: type,
    *args: Any,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    max_ongoing_requests: int = 16,
    heartbeat_s: float | None = None,
    **kwargs: Any,
):
    """Deploy `cls(*args, **kwargs)` as the Serve application `name` with one replica; return its handle.
    With `heartbeat_s` the replica posts a heartbeat as `name` that often (`relax.ops.heartbeat`)."""
    from ray import serve

    app = _application(name, cls, args, kwargs, num_cpus, num_gpus, max_ongoing_requests, heartbeat_s)
    handle = serve.run(app, name=name, route_prefix=None)
    logger.info("role %s is up", name)
    return handle


@dataclass
class RoleDeployment:
    """One role for `deploy_roles`: the Serve application `name` running `cls(*args, **kwargs)`."""

    name: str
    cls: type
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 16
    heartbeat_s: float | None = None
    cpus: str | None = None  # pin the replica's process to these CPUs (relax/utils/cpu_affinity.py)


def deploy_roles(roles: list[RoleDeployment]) -> dict[str, Any]:
    """Deploy every role at once and wait until all are running; return their handles by name.

    The replicas start in parallel (each imports torch and loads its model), which takes a run's start-up
    from the sum of the roles' start times to about the longest one. Roles must not call each other in
    their constructors (none does: they meet through the data plane and the Controller). Falls back to
    one `serve.run` after another where `serve.run_many` is missing (Ray < 2.41).
    """
    from ray import serve

    def app(r: RoleDeployment):
        return _application(
            r.name,
            r.cls,
            r.args,
            r.kwargs,
            r.num_cpus,
            r.num_gpus,
            r.max_ongoing_requests,
            r.heartbeat_s,
            r.cpus,
        )

    run_many = getattr(serve, "run_many", None)
    if run_many is None or len(roles) < 2:
        handles = {}
        for r in roles:
            handles[r.name] = serve.run(app(r), name=r.name, route_prefix=None)
            logger.info("role %s is up", r.name)
        return handles
    targets = [serve.RunTarget(app(r), name=r.name, route_prefix=None) for r in roles]
    handles = run_many(targets, wait_for_applications_running=True)
    logger.info("roles %s are up", ", ".join(r.name for r in roles))
    return {r.name: h for r, h in zip(roles, handles, strict=True)}


def delete_role(name: str) -> None:
    """Remove the Serve application `name` (its replica is stopped)."""
    from ray import serve

    serve.delete(name)
    logger.info("role %s removed", name)


def shutdown(stop_ray: bool) -> None:
    import ray
    from ray import serve

    if not ray.is_initialized():
        return
    try:
        serve.shutdown()
    except Exception:  # noqa: BLE001 - shutting down; the cluster may already be gone
        logger.exception("serve shutdown failed")
    if stop_ray:
        ray.shutdown()
