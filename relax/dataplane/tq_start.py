"""Starting TransferQueue's controller and storage units where the cluster has room for them.

TQ's own `transfer_queue.init` pins each storage unit to a node (hard node affinity, round robin over
the sorted node ids, whatever the node holds) and takes no placement for its actors. On a cluster whose
head has no CPU (Ray's advice for a head that only coordinates) a unit pinned there can never start; on
a head with one CPU it waits for the CPU the controller holds, and which node comes first in the order is
a coin flip. So Relax starts the same actors itself, with Ray's ordinary scheduling and the placement of
`resources.placement.data_plane` (custom resources, node labels), and waits for each with a deadline.
Processes that only use the data plane still attach through `transfer_queue.init()`, which finds the
controller by its name.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "TransferQueueController"  # the name `transfer_queue.init()` attaches to
NAMESPACE = "transfer_queue"
START_TIMEOUT_S = 180.0  # the controller and the storage units running and configured (process start-up)
SHUTDOWN_TIMEOUT_S = 15.0  # as TQ's own close: idle storage workers see a shutdown within a second


class DataPlaneStartError(RuntimeError):
    """TransferQueue's actors did not start in time; says what they ask for and what to change."""


@dataclass
class TQActors:
    """The running controller and storage units (handles) and the config every client reads."""

    controller: Any
    conf: Any
    units: dict[str, Any] = field(default_factory=dict)

    def close(self, graceful: bool = True) -> None:
        """Stop the storage units (gracefully, then killed; only killed when not `graceful`: a start that
        failed has units that may never run, and waiting for them to shut down would only wait out the
        timeout) and the controller. Never raises."""
        import ray

        units = list(self.units.values())
        try:
            if graceful:
                ray.get([u.shutdown.remote() for u in units], timeout=SHUTDOWN_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - they are killed below anyway
            logger.warning("TransferQueue storage units did not shut down gracefully: %s", e)
        for actor in [*units, self.controller]:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.units = {}


def start_tq(
    overrides: dict[str, Any],
    sampler: Any,
    options: dict[str, Any],
    timeout_s: float = START_TIMEOUT_S,
) -> TQActors:
    """Start TQ's controller (with `sampler`) and `backend.SimpleStorage.num_data_storage_units` storage
    units, each with the Ray actor `options` (`num_cpus`, `resources`, `label_selector`), and store the
    config (TQ's defaults merged with `overrides`) in the controller. Raises `DataPlaneStartError` when
    an actor is not running within `timeout_s`; nothing it started is left running then."""
    from importlib import resources

    from omegaconf import OmegaConf
    from transfer_queue.controller import TransferQueueController
    from transfer_queue.storage.simple_storage import SimpleStorageUnit

    conf = OmegaConf.create({}, flags={"allow_objects": True})
    conf = OmegaConf.merge(conf, OmegaConf.load(resources.files("transfer_queue") / "config.yaml"))
    conf = OmegaConf.merge(conf, OmegaConf.create(overrides))
    if conf.backend.storage_backend != "SimpleStorage":
        raise ValueError(
            f"Relax starts TransferQueue's SimpleStorage only, not {conf.backend.storage_backend}"
        )
    storage = dict(conf.backend.SimpleStorage)
    storage["_run_id"] = uuid.uuid4().hex  # one id the units share (TQ's bootstrap sets it the same way)
    deadline = time.monotonic() + timeout_s
    started = TQActors(
        TransferQueueController.options(name=CONTROLLER_NAME, namespace=NAMESPACE, **options).remote(
            sampler=sampler, polling_mode=conf.controller.polling_mode
        ),
        conf,
    )
    try:
        for i in range(int(storage["num_data_storage_units"])):
            unit = SimpleStorageUnit.options(**options).remote(config=storage)
            started.units[f"TransferQueueStorageUnit#{i}"] = unit
        conf.controller.zmq_info = _wait(
            started.controller.get_zmq_server_info.remote(), deadline, "controller", options, timeout_s
        )
        infos = _wait(
            [u.get_zmq_server_info.remote() for u in started.units.values()],
            deadline,
            "storage units",
            options,
            timeout_s,
        )
        conf.backend.SimpleStorage.zmq_info = dict(zip(started.units, infos, strict=True))
        _wait(started.controller.store_config.remote(conf), deadline, "controller", options, timeout_s)
    except BaseException:
        started.close(graceful=False)
        raise
    logger.info("TransferQueue: controller and %d storage unit(s) up, each %s", len(started.units), options)
    return started


def _wait(refs: Any, deadline: float, what: str, options: dict[str, Any], timeout_s: float) -> Any:
    import ray
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))
    except GetTimeoutError:
        free = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
        raise DataPlaneStartError(
            f"TransferQueue's {what} not running after {timeout_s:.0f}s; each asks for {options}, the "
            f"cluster has free {free}. Lower resources.data_plane_cpus, or point resources.placement.data_plane "
            "at nodes with room (docs/cluster.md)"
        ) from None
