"""Embedded inference engines as Ray actors, each serving the SGLang-compatible HTTP protocol on
127.0.0.1 (the `ray_native` way: Relax starts the engines it uses inside its own cluster).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from relax.utils.placement import bundle_options

logger = logging.getLogger(__name__)


@ray.remote
class EngineActor:
    """Hosts one `EngineServer`; the heavy engine is built inside the actor, only config travels."""

    def __init__(self, model_path: str, engine_kwargs: dict[str, Any], cpus: str | None = None) -> None:
        from relax.backends.inference.embedded.server import EngineServer
        from relax.utils.gc_freeze import freeze_startup_objects
        from relax.utils.logging import setup_logging

        setup_logging()
        if cpus is not None:  # before the engine starts its threads (relax/utils/cpu_affinity.py)
            from relax.utils.cpu_affinity import pin_process

            pin_process(cpus, "resources.rollout_cpus")
        self.server = EngineServer(model_path, host="127.0.0.1", port=0, **engine_kwargs)
        self.server.start()
        freeze_startup_objects()  # the engine's process: see relax/utils/gc_freeze.py

    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


class EngineGroup:
    """Starts `n` embedded engines and knows their URLs; `stop()` ends them.

    `num_gpus` per engine (a fraction shares a GPU); `gpu_group` names the placement group of one-GPU
    bundles that colocated engines share with the training ranks (engine i in bundle i mod G); `cpus`
    pins each engine's process to those CPUs (the rollout CPU budget).
    """

    def __init__(
        self,
        model_path: str,
        n: int,
        engine_kwargs: dict[str, Any],
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        gpu_group: str | None = None,
        cpus: str | None = None,
    ) -> None:
        self.model_path, self.engine_kwargs, self.cpus = model_path, engine_kwargs, cpus
        self.num_cpus, self.num_gpus, self.gpu_group = num_cpus, num_gpus, gpu_group
        self.actors = [self.launch(i) for i in range(n)]
        self.urls: list[str] = ray.get([a.url.remote() for a in self.actors])
        logger.info("embedded engines up: %s", self.urls)

    def launch(self, i: int) -> Any:
        """A new actor for engine slot `i`, with the group's CPU/GPU share and GPU bundle (a replacement
        sits where the engine it replaces sat)."""
        placement = bundle_options(self.gpu_group if self.num_gpus else None, i)
        return EngineActor.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, **placement).remote(
            self.model_path, self.engine_kwargs, self.cpus
        )

    def stop(self) -> None:
        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - the actor may already be gone
                pass
            ray.kill(actor)
        self.actors = []


class RayEngineProvider:
    """Starts one more embedded engine actor at a time (elastic `ray_native` scale-out)."""

    def __init__(
        self,
        model_path: str,
        engine_kwargs: dict[str, Any],
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        cpus: str | None = None,
    ) -> None:
        self.model_path, self.engine_kwargs, self.cpus = model_path, engine_kwargs, cpus
        self.num_cpus, self.num_gpus = num_cpus, num_gpus

    def launch(self) -> Any:
        """A new engine actor (with the run's GPU share per engine; outside any colocate GPU group)."""
        return EngineActor.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus).remote(
            self.model_path, self.engine_kwargs, self.cpus
        )

    async def url(self, handle: Any) -> str:
        return await handle.url.remote()

    async def stop(self, handle: Any, graceful: bool = True) -> None:
        if graceful:
            try:
                await asyncio.wait_for(handle.stop.remote(), timeout=30)
            except Exception as e:  # noqa: BLE001 - it may already be gone; it is killed below anyway
                logger.debug("engine actor stop: %s", e)
        ray.kill(handle)
