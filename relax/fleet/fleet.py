"""The Rollout role's inference engines as one fleet: the engines of `rollout.engine`'s backend (started
by Relax as Ray actors, or external ones it is given: `relax.backends.inference.registry`), the router
that balances requests over them, the supervisor that replaces failed engines Relax started, and the
elastic manager with its REST API (docs/elastic_api.md).

The Rollout role holds one `EngineFleet` and asks it, around each weight push, which engines the
weight-sync group should have (`plan`, `replace_dead`) and tells it how the push went (`admit`; the
elastic manager's `group_formed`, `join_failed`, `pushed`); `relax.orchestration.weight_push` runs that
sequence.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from relax.backends.inference.registry import engine_backend
from relax.config import RelaxConfig
from relax.fleet.engine_recovery import START_TIMEOUT_S, EngineSupervisor
from relax.rollout.router import Router
from relax.utils.net import bind_address

logger = logging.getLogger(__name__)

REPLACEMENT_WAIT_S = START_TIMEOUT_S + 120.0  # a replacement's start, then the push that gives it weights


class EngineFleet:
    def __init__(self, cfg: RelaxConfig) -> None:
        self.cfg = cfg
        # what kind of engines, and how they come to be, is the registry's (an unknown name raises there)
        self.backend = engine_backend(cfg.rollout.engine)
        if problem := self.backend.missing_package():
            raise RuntimeError(problem)
        engines = self.backend.start(cfg)
        self.group = engines if self.backend.in_cluster else None  # the engines Relax started and stops
        self.router = Router(engines.urls, timeout_s=cfg.rollout.request_timeout_s)
        self.supervisor = None  # replaces failed engines Relax started, before a push (engine_recovery.py)
        if self.group is not None:
            self.supervisor = EngineSupervisor(self.group, self.router, cfg.ops.heartbeat_interval_s)
            # a request whose only engine died waits for the replacement (a start and a weight push)
            self.router.replacement_wait_s = REPLACEMENT_WAIT_S
        self.elastic: Any = None  # ElasticManager, once `start_elastic` ran
        self._elastic_server: Any = None

    def urls(self) -> list[str]:
        """The engines that take requests now."""
        return self.router.urls()

    # -- elastic scaling ---------------------------------------------------------------------
    def start_elastic(self) -> str | None:
        """Serve the elastic API on the running event loop (the role's: Serve's); returns its URL, or None
        outside an event loop (the API needs the loop the role's async methods run on)."""
        from relax.fleet.elastic_api import ElasticServer
        from relax.fleet.elastic_manager import ElasticManager

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            logger.info("elastic API not started: the rollout runs outside an event loop")
            return None
        provider = None  # `ray_native` scale-out, where the backend can start one more engine
        if self.backend.provider is not None:
            import ray

            if ray.is_initialized():
                provider = self.backend.provider(self.cfg)
        e = self.cfg.rollout.elastic
        self.elastic = ElasticManager(
            self.router,
            self.router.urls(),
            provider=provider,
            operation_timeout_s=e.operation_timeout_s,
            drain_timeout_s=e.drain_timeout_s,
            max_engines=e.max_engines,
        )
        host = e.host or bind_address(self.cfg.resources.bind)
        self._elastic_server = ElasticServer(self.elastic, loop, host, e.port)
        return self._elastic_server.start()

    def plan(self) -> list[str] | None:
        """Before a weight push: the engines the weight-sync group should have, or None if unchanged."""
        return self.elastic.plan() if self.elastic is not None else None

    # -- failed engines ----------------------------------------------------------------------
    async def replace_dead(self) -> dict:
        """Replace failed embedded engines; `urls` is the weight-sync group to form, `replaced` how many,
        `pending` the replacements that hold no weights yet."""
        if self.supervisor is None:
            return {"urls": self.router.urls(), "replaced": 0, "pending": []}
        return await self.supervisor.replace_dead()

    def admit(self) -> list[str]:
        """Replacement engines that received the current weights start taking requests."""
        return self.supervisor.admit() if self.supervisor is not None else []

    async def close(self) -> None:
        """Stop the elastic API and its operations, the supervisor, the router and the engines Relax
        started (external engines keep running)."""
        if self._elastic_server is not None:
            self._elastic_server.stop()
            self._elastic_server = None
        if self.elastic is not None:
            await self.elastic.close()
            self.elastic = None
        if self.supervisor is not None:
            self.supervisor.stop()
        await self.router.close()
        if self.group is not None:
            await asyncio.to_thread(self.group.stop)
            self.group = None
