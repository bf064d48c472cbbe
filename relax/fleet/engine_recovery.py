"""Replacing failed inference engines inside the Rollout role (the engines Relax started: embedded, SGLang).

`EngineSupervisor` watches the engine actors of an engine group (an `EngineSet` of
`relax.backends.inference.registry`) from a daemon thread, every heartbeat interval: it posts an `engine/<i>` heartbeat for each engine that answers (its pid, so operators and
tests can find it), and an engine whose actor is gone is replaced at once, whatever the run is doing.
Before each weight push `replace_dead()` also replaces engines that are alive but fail the router's
health probe. A failed engine is killed and a fresh one started in its slot; the old URL leaves the
router. The replacement is *pending*: it joins the weight-sync group with the survivors and gets the
current weights with the next push; only then does `admit()` put it in the router, so no request is
answered with stale weights.

Requests that were running on the failed engine fail over to another engine in the router, from scratch,
so no sample is lost or counted twice. When no engine is left to serve (the only engine died) they wait
in the router (`Router.replacement_wait_s`) instead of failing. The supervisor says so on the board: an
`engines` beat with `waiting` (requests waiting for an engine) and `pending` (replacement URLs); the
HealthManager then has the driver push the current weights to the replacements at once
(`relax.orchestration.health.HealthManager.watch_engines`), rather than at the next step's push, which
could never come while the step's rollout waits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from typing import Any

import ray

from relax.ops.heartbeat import get_board

logger = logging.getLogger(__name__)

PING_TIMEOUT_S = 10.0
START_TIMEOUT_S = 600.0  # a replacement's start (its model load included)
GONE = "gone"  # `_check`: the actor died
SILENT = "silent"  # `_check`: it did not answer in time


def _pid(actor_self: Any) -> int:
    return os.getpid()


class EngineSupervisor:
    def __init__(self, group: Any, router: Any, interval_s: float) -> None:
        self.group = group  # an EngineSet of the registry: .actors and .urls, replaced in place; .launch(i)
        self.router = router
        self.interval_s = interval_s
        self.pending: list[str] = []  # replacement URLs waiting for weights before they take traffic
        self.restarts = 0
        self._dead: list[str] = []  # URLs of replaced engines still in the router (it is left on the loop)
        self._unreported = 0  # replacements `replace_dead` has not yet counted
        self._offered: set[str] = set()  # pending replacements `replace_dead` named for the group
        # The beat thread and the role's event loop (through worker threads) both replace engines; the
        # lock guards the bookkeeping, never a start (the loop takes it too).
        self._changed = threading.Condition()
        self._starting: set[int] = set()  # slots whose replacement is starting
        self._incarnation = uuid.uuid4().hex
        self._stop = threading.Event()
        threading.Thread(target=self._beat_loop, name="engine-heartbeats", daemon=True).start()

    def _check(self, actor: Any) -> int | str:
        """The actor's pid, or GONE (it died) or SILENT (dying or hung)."""
        try:
            return ray.get(actor.__ray_call__.remote(_pid), timeout=PING_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            return GONE
        except Exception:  # noqa: BLE001 - hung, or its node is unreachable: no beat
            return SILENT

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat_round()
            except Exception:  # noqa: BLE001 - the supervisor must outlive one bad round
                logger.exception("engine supervisor: a round failed")

    def _beat_round(self) -> None:
        board = get_board()
        for i, actor in enumerate(list(self.group.actors)):
            state = self._check(actor)
            if state == GONE and not self._stop.is_set():
                self._replace(i, actor, "its actor is gone")
            elif isinstance(state, int) and board is not None:
                info = {"url": self.group.urls[i]} if i < len(self.group.urls) else {}
                board.beat.remote(f"engine/{i}", actor._actor_id.hex(), state, info)
        if board is not None:
            info = {"waiting": self.router.waiting, "pending": list(self.pending)}
            board.beat.remote("engines", self._incarnation, os.getpid(), info)

    def _replace(self, i: int, actor: Any, why: str) -> None:
        """Kill engine `i` (if it is still `actor`) and start a pending replacement in its slot; blocks
        while it starts (or while another caller's replacement of that slot starts)."""
        with self._changed:
            while i in self._starting:
                self._changed.wait()
            if self.group.actors[i] is not actor:
                return  # replaced meanwhile
            self._starting.add(i)
            url = self.group.urls[i]
        try:
            logger.warning("engine %d at %s failed (%s); replacing it", i, url, why)
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            new = self.group.launch(i)
            new_url = ray.get(new.url.remote(), timeout=START_TIMEOUT_S)
            with self._changed:
                self.group.actors[i], self.group.urls[i] = new, new_url
                if url in self.pending:  # a replacement that failed before it took traffic
                    self.pending.remove(url)
                else:
                    self._dead.append(url)
                self.pending.append(new_url)
                self._unreported += 1
                self.restarts += 1
            logger.info(
                "engine %d replaced: %s (takes requests once it holds the current weights)", i, new_url
            )
        finally:
            with self._changed:
                self._starting.discard(i)
                self._changed.notify_all()

    def _drop_dead(self) -> None:
        """Replaced engines leave the router (on the role's event loop, which owns the router)."""
        with self._changed:
            dead, self._dead = self._dead, []
        for url in dead:
            self.router.remove_engine(url)

    async def replace_dead(self) -> dict[str, Any]:
        """Replace every engine that is gone or unhealthy; returns `urls` (survivors and replacements,
        the weight-sync group to form), `replaced` (replacements since the last call) and `pending`
        (replacements that hold no weights yet)."""
        health = await self.router.probe()
        for i, actor in enumerate(list(self.group.actors)):
            url = self.group.urls[i]
            if health.get(url) is True:  # its server, inside the actor, answered just now: nothing to ping
                continue
            state = await asyncio.to_thread(self._check, actor)
            if isinstance(state, int) and health.get(url, True):
                continue  # alive, and not a router member (a pending replacement)
            why = "its actor is gone" if state == GONE else "it does not answer"
            await asyncio.to_thread(self._replace, i, actor, why)
        self._drop_dead()
        with self._changed:
            replaced, self._unreported = self._unreported, 0
            pending = list(self.pending)
            self._offered = set(pending)
        # The group to form: every engine the router serves (engines added by the elastic API too) and
        # the replacements, which join the router only once they hold the current weights.
        urls = self.router.urls() + [u for u in pending if u not in self.router.urls()]
        return {"urls": urls, "replaced": replaced, "pending": pending}

    def admit(self) -> list[str]:
        """Replacements that now hold the current weights (those the last `replace_dead` named for the
        group just pushed) start taking requests."""
        self._drop_dead()
        with self._changed:
            admitted = [u for u in self.pending if u in self._offered]
            self.pending = [u for u in self.pending if u not in self._offered]
        for url in admitted:
            self.router.add_engine(url)
        return admitted

    def stop(self) -> None:
        self._stop.set()
