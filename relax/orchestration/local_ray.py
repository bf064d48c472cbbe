"""Starting a local Ray cluster on a machine whose cores are busy.

Ray's raylet gives its dashboard agent a fixed 15 s to write its port files (`WaitForDashboardAgentPorts`
in Ray's node manager; no setting changes it) and aborts when the agent is late; `ray.init` then waits
another 30 s and raises "The current node timed out during startup". The agent is a Python process that
imports a few CPU-seconds of modules, so a machine whose cores are taken (other runs starting, a small CI
machine, a shared login node) misses the window although nothing is wrong. The failed attempt leaves its
head processes (the GCS, the dashboard, the monitors) running as children of this process: they are
killed and Ray is started again, `START_ATTEMPTS` times in all, before the run fails with what to do.

A cluster Relax joins (`resources.ray_address`) is not retried here: its nodes are someone else's.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

START_ATTEMPTS = 3
# ray/_private/node.py's message for a node that never registered
_NODE_TIMED_OUT = "timed out during startup"


class RayStartError(RuntimeError):
    """A local Ray cluster did not start in `START_ATTEMPTS` attempts; says why and what to change."""


def init_local_ray(**init_kwargs: Any) -> Any:
    """`ray.init(**init_kwargs)` for a cluster started on this machine, started again (after killing what
    the failed attempt left) when its node timed out during startup. Returns `ray.init`'s context."""
    import ray

    for attempt in range(1, START_ATTEMPTS + 1):
        before = {p.pid for p in _ray_children()}
        try:
            return ray.init(**init_kwargs)
        except Exception as e:
            if _NODE_TIMED_OUT not in str(e):
                raise
            left = [p for p in _ray_children() if p.pid not in before]
            _kill(left)
            if attempt == START_ATTEMPTS:
                raise RayStartError(
                    f"the local Ray cluster did not start in {START_ATTEMPTS} attempts: each time its node "
                    "timed out during startup (Ray's dashboard agent has a fixed 15 s to start, and this "
                    "machine's cores were too busy for it). Start Relax when the machine is less loaded, or "
                    "start Ray yourself (`ray start --head --node-ip-address=127.0.0.1`) and pass "
                    "resources.ray_address=auto"
                ) from e
            logger.warning(
                "the local Ray cluster's node timed out during startup (attempt %d of %d: Ray's dashboard "
                "agent was slower than Ray's fixed 15 s on this busy machine); stopped its %d leftover "
                "process(es) and starting Ray again",
                attempt,
                START_ATTEMPTS,
                len(left),
            )
    raise AssertionError("unreachable")


def _ray_children() -> list[Any]:
    """This process's descendants that belong to Ray (its GCS, raylet, dashboard, agents, monitors)."""
    import psutil

    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            argv = " ".join(p.cmdline())
        except psutil.Error:  # gone, or a zombie already reaped
            continue
        if "ray" in argv:
            found.append(p)
    return found


def _kill(procs: list[Any]) -> None:
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)
