"""Embedded inference engines as Ray actors, each serving the SGLang-compatible HTTP protocol on the
address `resources.bind` gives (127.0.0.1 on one machine, its node's address on a cluster; the
`ray_native` way: Relax starts the engines it uses inside its own cluster).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from relax.utils.auth import process_token
from relax.utils.placement import bundle_options

logger = logging.getLogger(__name__)


@ray.remote
class EngineActor:
    """Hosts one `EngineServer`; the heavy engine is built inside the actor, only config travels."""

    def __init__(
        self,
        model_path: str,
        engine_kwargs: dict[str, Any],
        cpus: str | None = None,
        bind: str = "auto",
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the run's token, which the engine requires (it arrives as an argument, never in
        the actor's environment or options)."""
        from relax.backends.inference.embedded.http.server import EngineServer
        from relax.utils.auth import set_process_token
        from relax.utils.gc_freeze import freeze_startup_objects
        from relax.utils.logging import setup_logging
        from relax.utils.net import bind_address

        set_process_token(api_key)  # masked in this process's logs from here on
        setup_logging()
        if cpus is not None:  # before the engine starts its threads (relax/utils/cpu_affinity.py)
            from relax.utils.cpu_affinity import pin_process

            pin_process(cpus, "resources.rollout_cpus")
        self.server = EngineServer(
            model_path, host=bind_address(bind), port=0, api_key=api_key, **engine_kwargs
        )
        self.server.start()
        freeze_startup_objects()  # the engine's process: see relax/utils/gc_freeze.py

    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()


ENGINE_START_TIMEOUT_S = 600.0  # model load included; past it the engines' demand is named in the error


def wait_for_urls(actors: list[Any], demand: str, timeout_s: float = ENGINE_START_TIMEOUT_S) -> list[str]:
    """The engines' URLs once they serve; an engine that fails raises its error, and engines still not
    up after `timeout_s` (not placed: the cluster lacks what they ask for) raise an error naming it."""
    from ray.exceptions import GetTimeoutError

    try:
        return ray.get([a.url.remote() for a in actors], timeout=timeout_s)
    except GetTimeoutError:
        free = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
        raise RuntimeError(
            f"{len(actors)} embedded engine(s) did not start within {timeout_s:.0f}s; each asks for {demand}, "
            f"the cluster has free {free}. Lower rollout.num_engines or resources.engine_gpus, or fix "
            "resources.placement.engines"
        ) from None


class EngineGroup:
    """Starts `n` embedded engines and knows their URLs; `stop()` ends them.

    `num_gpus` per engine (a fraction shares a GPU); `gpu_group` names the placement group of one-GPU
    bundles that colocated engines share with the training ranks (engine i in bundle i mod G); `cpus`
    pins each engine's process to those CPUs (the rollout CPU budget); `bind`: `resources.bind`;
    `placement`: Ray options that place each engine (`resources.placement.engines`: custom resources,
    a node label selector), used outside a GPU group.
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
        bind: str = "auto",
        placement: dict[str, Any] | None = None,
    ) -> None:
        self.model_path, self.engine_kwargs, self.cpus = model_path, engine_kwargs, cpus
        self.num_cpus, self.num_gpus, self.gpu_group = num_cpus, num_gpus, gpu_group
        self.bind, self.placement = bind, placement or {}
        self.actors = [self.launch(i) for i in range(n)]
        self.urls: list[str] = wait_for_urls(self.actors, self._demand())
        logger.info("embedded engines up: %s", self.urls)

    def _demand(self) -> str:
        return f"{{CPU: {self.num_cpus:g}, GPU: {self.num_gpus:g}, {self.placement or 'no placement'}}}"

    def launch(self, i: int) -> Any:
        """A new actor for engine slot `i`, with the group's CPU/GPU share and GPU bundle (a replacement
        sits where the engine it replaces sat)."""
        bundle = bundle_options(self.gpu_group if self.num_gpus else None, i)
        options = bundle or self.placement  # a GPU bundle already says where the engine goes
        return EngineActor.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, **options).remote(
            self.model_path, self.engine_kwargs, self.cpus, self.bind, process_token()
        )

    def stop(self) -> None:
        """Stop every engine's server, kill its actor, and return once the actors are gone: `ray.kill`
        only asks, and an engine that still answered after a stop (its CPUs, its port, its GPU memory
        still held) would meet the replacements a restart starts next."""
        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - the actor may already be gone
                pass
            ray.kill(actor)
        wait_gone(self.actors)
        self.actors = []


def wait_gone(actors: list[Any], timeout_s: float = 30.0) -> None:
    """Return once each of the (killed) `actors` is dead, or after `timeout_s` (logged)."""
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    for actor in actors:
        while time.monotonic() < deadline:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=max(0.1, deadline - time.monotonic()))
            except RayActorError:
                break
            except GetTimeoutError:
                continue
            time.sleep(0.05)
        else:
            logger.warning("an engine actor was still alive %.0fs after it was killed", timeout_s)
            return


class RayEngineProvider:
    """Starts one more embedded engine actor at a time (elastic `ray_native` scale-out)."""

    def __init__(
        self,
        model_path: str,
        engine_kwargs: dict[str, Any],
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        cpus: str | None = None,
        bind: str = "auto",
        placement: dict[str, Any] | None = None,
    ) -> None:
        self.model_path, self.engine_kwargs, self.cpus = model_path, engine_kwargs, cpus
        self.num_cpus, self.num_gpus, self.bind, self.placement = num_cpus, num_gpus, bind, placement or {}

    def launch(self) -> Any:
        """A new engine actor (with the run's GPU share and placement per engine; outside any colocate
        GPU group)."""
        options = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, **self.placement}
        return EngineActor.options(**options).remote(
            self.model_path, self.engine_kwargs, self.cpus, self.bind, process_token()
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
