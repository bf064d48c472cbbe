"""Starting and stopping the Ray cluster, Ray Serve, and one Serve application per role.

Each role is its own Serve application, so a failed replica is restarted by Serve without touching the
other roles. Role classes are plain Python classes; `deploy_role` wraps them with `serve.deployment`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# Loopback-only, no auth on dev machines; the user's own environment wins.
RAY_ENV_DEFAULTS = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def set_ray_env_defaults() -> None:
    for k, v in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(k, v)


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
    handle = serve.run(deployment.bind(*args, **kwargs), name=name, route_prefix=None)
    logger.info("role %s is up", name)
    return handle


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
