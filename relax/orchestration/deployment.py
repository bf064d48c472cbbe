"""The run's roles as Serve applications (one per role, relax/orchestration/service.py), the data plane
they share and, in colocate on GPUs, the placement group engines and training ranks share: started
together for an attempt (`Deployment.start`), one role restarted in place (`redeploy`: the `Redeploy`
of relax/orchestration/interfaces.py), all stopped at the attempt's end (`stop`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from relax.config import RelaxConfig
from relax.dataplane.plane import DataPlane, create_data_plane
from relax.dataplane.tq_start import DataPlaneStartError
from relax.orchestration import gpus, service
from relax.orchestration.registry import RoleSpec, run_roles
from relax.orchestration.stop import StopRequest
from relax.utils.net import bind_address
from relax.utils.placement import ray_placement

logger = logging.getLogger(__name__)


class Deployment:
    def __init__(
        self, cfg: RelaxConfig, cluster_gpus: int, stop: StopRequest, *, cluster_ends_with_run: bool = False
    ) -> None:
        """`cluster_gpus`: the cluster's GPUs, as the run's GPU plan counted them (`gpus.plan_gpus`);
        `cluster_ends_with_run`: the run started the Ray cluster and stops it when it ends."""
        self.cfg, self.cluster_gpus, self.stop_request = cfg, cluster_gpus, stop
        self.cluster_ends_with_run = cluster_ends_with_run
        self.specs: dict[str, RoleSpec] = {}
        self.handles: dict[str, Any] = {}  # role name -> Serve handle of its running replica
        self.plane: DataPlane | None = None
        self._gpu_group = None  # colocate on GPUs: the placement group engines and ranks share

    def start(self, resume_step: int | None) -> dict[str, Any]:
        """Deploy every role (the Metrics service appends after `resume_step`) and the data plane;
        returns the roles' handles by name. A stop request ends the start (`RunStopped`)."""
        self.stop_request.check("the roles started")
        self._gpu_group = gpus.ensure_gpu_group(self.cfg, self.cluster_gpus)
        service.start_serve(self.cfg.run.run_dir / "logs")
        self.specs = {spec.name: spec for spec in run_roles(self.cfg, resume_step)}
        r = self.cfg.resources
        # The data plane (TransferQueue's controller and storage units: seconds of process start-up on a
        # small host) starts while the roles' replicas start; roles connect to it on first use, which
        # is after this method returns.
        plane = _Background(
            create_data_plane,
            self.cfg.schedule.data_plane,
            bind_address(r.bind),
            {"num_cpus": r.data_plane_cpus, **ray_placement(self.cfg, "data_plane")},
        )
        try:
            self.handles.update(self._deploy([self._role(name) for name in self.specs]))
        except BaseException:
            plane.abandon(_close_plane)  # a stop or a failed role does not wait for it
            raise
        try:
            self.plane = plane.result(lambda: self.stop_request.check("the data plane started"), _close_plane)
        except DataPlaneStartError as e:
            raise service.RoleStartError("data_plane", str(e)) from e
        return self.handles

    def redeploy(self, name: str) -> Any:
        """Restart role `name` in place; a new Metrics replica appends to the run's metrics."""
        service.delete_role(name)
        override = {"resume_step": None} if name == "metrics" else {}
        self.handles[name] = self._deploy([self._role(name, **override)])[name]
        return self.handles[name]

    def stop(self) -> None:
        """Stop the engines, close the metrics, delete every role, close the data plane and free the GPU
        group; best effort, as a replica may be gone."""
        for name, call in (("rollout", "stop_engines"), ("metrics", "close")):
            try:
                if name in self.handles:
                    getattr(self.handles[name], call).remote().result(timeout_s=60)
            except Exception:  # noqa: BLE001 - best effort on the way out; the replica may be gone
                logger.exception("%s: %s failed", name, call)
        self.handles.clear()
        if self.plane is not None:
            asyncio.run(self.plane.close())
            self.plane = None
        if self.cluster_ends_with_run and self.stop_request.requested:
            # the run ends, and the Ray cluster it started with it, which kills the replicas: Serve's
            # graceful stop would wait for each (a constructor still running at start-up, an update past
            # ops.stop_grace_s) and then its stop timeout. The engines and the metrics were closed above,
            # and a replica holds nothing else to save.
            logger.info("the run stops: its roles end with the Ray cluster it started")
        else:
            service.delete_roles()  # Serve itself stops with the run (`service.shutdown`)
        if self._gpu_group is not None:
            from ray.util import remove_placement_group

            remove_placement_group(self._gpu_group)
            self._gpu_group = None

    def _deploy(self, roles: list[service.RoleDeployment]) -> dict[str, Any]:
        return service.deploy_roles(roles, should_stop=lambda: self.stop_request.requested)

    def _role(self, name: str, **override: Any) -> service.RoleDeployment:
        spec = self.specs[name]
        return service.RoleDeployment(
            name,
            spec.cls,
            (self.cfg,),
            {**spec.kwargs, **override},
            num_cpus=spec.num_cpus,
            num_gpus=gpus.role_gpus(self.cfg, name),
            heartbeat_s=self.cfg.ops.heartbeat_interval_s,
            cpus=getattr(self.cfg.resources, f"{spec.budget}_cpus") if spec.budget else None,
            placement=ray_placement(self.cfg, name),
        )


class _Background:
    """`fn(*args)` on a daemon thread: a call stuck in Ray never keeps the process from exiting, and the
    waiting thread can give up on it."""

    WAIT_SLICE_S = 0.2  # how often `result` looks at its `check`

    def __init__(self, fn, *args) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._value, self._error, self._close = None, None, None
        self._finished = threading.Event()
        threading.Thread(target=self._run, args=(fn, *args), name="data-plane", daemon=True).start()

    def _run(self, fn, *args) -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            value, error = None, e
        with self._lock:
            self._value, self._error, self._done = value, error, True
            close = self._close
        self._finished.set()
        if close is not None and value is not None:
            close(value)  # given up on: nobody else will close it

    def abandon(self, close) -> None:
        """Nobody will take the value: `close(value)` now if it is there, else when it comes."""
        with self._lock:
            done, self._close = self._done, close
        if done and self._value is not None:
            close(self._value)

    def result(self, check, close):
        """The value, calling `check()` (which raises to give up; the value then goes to `close`)
        between short waits."""
        try:
            while not self._finished.wait(self.WAIT_SLICE_S):
                check()
        except BaseException:
            self.abandon(close)
            raise
        if self._error is not None:
            raise self._error
        return self._value


def _close_plane(plane: DataPlane) -> None:
    try:
        asyncio.run(plane.close())
    except Exception:  # noqa: BLE001 - closing the data plane on the way out
        logger.exception("closing the data plane failed")
