"""Replacing failed inference engines inside the Rollout role (embedded engines started by Relax).

`EngineSupervisor` watches the engine actors of an `EngineGroup`: a daemon thread posts an `engine/<i>`
heartbeat for each engine that answers (its pid, so operators and tests can find it). Before each weight
push the Controller calls `replace_dead()`: an engine whose actor is gone or whose HTTP server fails the
router's health probe is killed, dropped from the router and replaced by a fresh engine. The replacement
joins the weight-sync group with the survivors and gets the current weights with the push; only then
does `admit()` put it in the router, so no request is answered with stale weights.

Requests that were running on the failed engine fail over to another engine in the router, from scratch,
so no sample is lost or counted twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import ray

from relax.ops.heartbeat import get_board

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 10.0


def _pid(actor_self: Any) -> int:
    return os.getpid()


class EngineSupervisor:
    def __init__(
        self, group: Any, router: Any, model_path: str, engine_kwargs: dict, interval_s: float
    ) -> None:
        self.group = group  # EngineGroup: .actors and .urls, replaced in place
        self.router = router
        self.model_path = model_path
        self.engine_kwargs = engine_kwargs
        self.interval_s = interval_s
        self.pending: list[str] = []  # replacement URLs waiting for weights before they take traffic
        self.restarts = 0
        self._stop = threading.Event()
        threading.Thread(target=self._beat_loop, name="engine-heartbeats", daemon=True).start()

    def _ping(self, actor: Any) -> int | None:
        try:
            return ray.get(actor.__ray_call__.remote(_pid), timeout=PING_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - dead, dying or hung: no beat
            return None

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            board = get_board()
            for i, actor in enumerate(list(self.group.actors)):
                pid = self._ping(actor)
                if pid is not None and board is not None:
                    info = {"url": self.group.urls[i]} if i < len(self.group.urls) else {}
                    board.beat.remote(f"engine/{i}", actor._actor_id.hex(), pid, info)

    async def replace_dead(self) -> dict[str, Any]:
        """Replace every engine that is gone or unhealthy; returns `urls` (survivors and replacements,
        the weight-sync group to form) and `replaced` (how many were replaced now)."""
        health = await self.router.probe()
        replaced = 0
        for i, actor in enumerate(list(self.group.actors)):
            url = self.group.urls[i]
            if health.get(url) is True:  # its server, inside the actor, answered just now: nothing to ping
                continue
            alive = await asyncio.to_thread(self._ping, actor)
            if alive is not None and health.get(url, True):
                continue
            logger.warning(
                "engine %d at %s failed (%s); replacing it", i, url, "gone" if alive is None else "unhealthy"
            )
            self.router.remove_engine(url)
            ray.kill(actor, no_restart=True)
            new = self.group.launch(i)
            new_url = await asyncio.to_thread(ray.get, new.url.remote())
            self.group.actors[i], self.group.urls[i] = new, new_url
            self.pending.append(new_url)
            replaced += 1
            self.restarts += 1
            logger.info("engine %d replaced: %s", i, new_url)
        # The group to form: every engine the router serves (engines added by the elastic API too) and
        # the replacements, which join the router only once they hold the current weights.
        urls = self.router.urls() + [u for u in self.pending if u not in self.router.urls()]
        return {"urls": urls, "replaced": replaced}

    def admit(self) -> list[str]:
        """Replacements that now hold the current weights start taking requests."""
        admitted, self.pending = self.pending, []
        for url in admitted:
            self.router.add_engine(url)
        return admitted

    def stop(self) -> None:
        self._stop.set()
