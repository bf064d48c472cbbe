"""The elastic rollout manager: runs scale operations (`relax.fleet.elastic_ops`) against the router and
the weight-sync group, on the Rollout role's event loop.

Engines join and leave the weight-sync group only at a weight push, where the trainer is idle and its
weights are final for the step. The push sequence (`relax.orchestration.step_flow.StepFlow`) asks for
`plan()` (the members the group should have, or None when it is right), re-forms the group with them
(`group_formed`, or `join_failed` and a fallback), publishes, and reports `pushed(version)`. So:

* a new engine takes traffic only after a push gave it the trainer's current weights and it reports
  that version (checked over HTTP); every later push includes it;
* a removed engine first leaves the router (no new requests; in-flight ones finish there within
  `drain_timeout_s`, else the engine is killed and the router re-sends them elsewhere), then leaves the
  group at the next push, and only then is stopped (a stopped member would break the next broadcast).

Rollback undoes the steps taken so far in reverse; an engine that already belongs to the group is
stopped after the next push has re-formed the group without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from relax.engine_api.client import EngineClient
from relax.engine_api.protocol import version_to_engine
from relax.fleet.elastic_ops import BadRequest, Conflict, Operation, OperationBook, OpState
from relax.rollout.router import Router
from relax.weights.sync_group import WEIGHT_GROUP

logger = logging.getLogger(__name__)
S = OpState
Undo = list[Callable[[], Awaitable[None]]]


class EngineProvider(Protocol):
    """Starts and stops engines for `ray_native` scale-out."""

    def launch(self) -> Any:
        """Start one engine; returns its handle at once (before it serves)."""

    async def url(self, handle: Any) -> str:
        """Wait until the engine serves; its base URL."""

    async def stop(self, handle: Any, graceful: bool = True) -> None:
        """Stop it; `graceful=False` kills it at once (its clients see a dropped connection)."""


@dataclass
class EngineRecord:
    url: str
    origin: str  # "initial" (present at start, protected) | "ray_native" | "external"
    seq: int  # join order; scale-in to a number removes the highest first (last in, first out)
    state: str = "active"  # joining | active | draining
    handle: Any = None  # the provider's handle (ray_native engines), None for others
    pushed_version: str | None = None  # version of the first push that included it
    join_error: str | None = None  # why it could not join the weight-sync group
    added_at: float = 0.0

    @property
    def protected(self) -> bool:
        return self.origin == "initial"


class ElasticManager:
    def __init__(
        self,
        router: Router,
        initial_urls: list[str],
        *,
        provider: EngineProvider | None,
        operation_timeout_s: float = 600.0,
        drain_timeout_s: float = 60.0,
        max_engines: int = 16,
    ) -> None:
        self.router, self.provider = router, provider
        self.operation_timeout_s, self.drain_timeout_s = operation_timeout_s, drain_timeout_s
        self.max_engines = max_engines
        now = time.time()
        urls = [u.rstrip("/") for u in initial_urls]
        self.records = {u: EngineRecord(u, "initial", i, added_at=now) for i, u in enumerate(urls)}
        self.clients = {u: EngineClient(u, timeout_s=30.0) for u in urls}
        self.members = list(urls)  # the weight-sync group as last formed
        self.desired = list(urls)  # the members the next push should have
        self.version: str | None = None  # of the last push
        self.book = OperationBook()
        self._tasks: dict[str, asyncio.Task] = {}
        self._reap: list[EngineRecord] = []  # left the router; stopped once out of the group
        self._seq = len(urls)
        self._cond = asyncio.Condition()

    # -- requests ----------------------------------------------------------------------------
    async def scale_out(self, request: dict[str, Any], key: str | None = None) -> tuple[Operation, bool]:
        """`{"mode": "ray_native", "num_engines": N}` (reach N engines) or `{"mode": "external",
        "engine_urls": [...]}`; returns (operation, created)."""
        if (op := self._replay("scale_out", request, key)) is not None:
            return op, False
        self._check_idle()  # the engines are in flux while another operation runs
        if request.get("mode") == "ray_native":
            if self.provider is None:
                raise BadRequest("this rollout cannot start engines (no Ray); use mode external")
            target, current = int(request["num_engines"]), len(self.records)
            if target > self.max_engines:
                raise BadRequest(
                    f"num_engines={target} is above rollout.elastic.max_engines={self.max_engines}"
                )
            if target <= current:
                raise BadRequest(
                    f"there are already {current} engines; num_engines must be above that (scale_in reduces)"
                )
        else:
            urls = [u.rstrip("/") for u in request["engine_urls"]]
            if len(set(urls)) != len(urls):
                raise BadRequest(f"engine_urls lists an engine twice: {urls}")
            if known := [u for u in urls if u in self.records]:
                raise BadRequest(f"already engines of this rollout: {known}")
            if len(self.records) + len(urls) > self.max_engines:
                raise BadRequest(f"that would pass rollout.elastic.max_engines={self.max_engines}")
        return self._start("scale_out", request, key, self._scale_out)

    async def scale_in(self, request: dict[str, Any], key: str | None = None) -> tuple[Operation, bool]:
        """`{"num_engines": N}` (last in, first out) or `{"engine_urls": [...]}`; engines present at
        start are protected. Returns (operation, created)."""
        if (op := self._replay("scale_in", request, key)) is not None:
            return op, False
        self._check_idle()  # the engines are in flux while another operation runs
        active = [r for r in self.records.values() if r.state == "active"]
        if request.get("engine_urls"):
            urls = [u.rstrip("/") for u in request["engine_urls"]]
            for u in urls:
                rec = self.records.get(u)
                if rec is None:
                    raise BadRequest(f"unknown engine {u!r}; GET /v1/engines lists the engines")
                if rec.protected:
                    raise BadRequest(
                        f"engine {u} was present at start and is protected; it cannot be removed"
                    )
                if rec.state != "active":
                    raise BadRequest(f"engine {u} is {rec.state}, not active")
            if len(set(urls)) != len(urls):
                raise BadRequest(f"engine_urls lists an engine twice: {urls}")
        else:
            target = int(request["num_engines"])
            removable = sorted((r for r in active if not r.protected), key=lambda r: -r.seq)
            k = len(active) - target
            if k <= 0:
                raise BadRequest(f"there are {len(active)} active engines; num_engines must be below that")
            if k > len(removable):
                raise BadRequest(
                    f"only {len(removable)} engines can be removed (down to {len(active) - len(removable)}); "
                    "engines present at start are protected"
                )
            urls = [r.url for r in removable[:k]]
        op, created = self._start("scale_in", request, key, self._scale_in)
        if created:
            op.engines = urls
        return op, created

    async def get(self, op_id: str) -> Operation:
        return self.book.get(op_id)

    async def operations(self) -> list[Operation]:
        return list(self.book.ops.values())

    async def cancel(self, op_id: str) -> Operation:
        op = self.book.get(op_id)
        if op.done:
            raise Conflict(f"operation {op.id} has already ended ({op.state.value}); nothing to cancel")
        if not op.cancellable:
            raise Conflict(f"operation {op.id} is past the point where it can be undone ({op.message})")
        op.cancel_requested = True
        task = self._tasks.get(op.id)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        return op

    async def engines(self) -> list[dict[str, Any]]:
        """Every engine with its live health (a `/health` probe) and the version it reports."""
        routed = {row["url"]: row for row in self.router.status()}

        async def one(rec: EngineRecord) -> dict[str, Any]:
            client = self.clients.get(rec.url)
            try:
                if client is None:
                    raise RuntimeError("stopped")
                await client.health(timeout_s=3.0)
                healthy, version = True, await client.weight_version()
            except Exception as e:  # noqa: BLE001 - any failure means unhealthy
                healthy, version = False, None
                logger.debug("engine %s: %s", rec.url, e)
            row = routed.get(rec.url, {})
            return {
                "url": rec.url,
                "origin": rec.origin,
                "protected": rec.protected,
                "state": rec.state,
                "healthy": healthy,
                "routed": rec.url in routed,
                "outstanding": self.router.outstanding(rec.url),
                "served": row.get("served", 0),
                "weight_version": version,
                "in_weight_sync_group": rec.url in self.members,
            }

        return list(
            await asyncio.gather(*(one(r) for r in sorted(self.records.values(), key=lambda r: r.seq)))
        )

    # -- the weight push (called by the Rollout role for StepFlow.push_weights) --------------
    def plan(self) -> list[str] | None:
        """The members the weight-sync group should have before this push, or None if it has them."""
        return list(self.desired) if self.desired != self.members else None

    async def join_failed(self, error: str) -> list[str]:
        """Forming the planned group failed: the joining engines fail; returns the members to use."""
        for u in [u for u in self.desired if u not in self.members]:
            if u in self.records:
                self.records[u].join_error = error
            self.desired.remove(u)
        await self._notify()
        return list(self.desired)

    async def group_formed(self, urls: list[str]) -> None:
        self.members = [u.rstrip("/") for u in urls]
        running = self.book.running()
        if running is not None and running.state is S.REMOVING:
            running.cancellable = not all(u not in self.members for u in running.engines)
        for rec in [r for r in self._reap if r.url not in self.members]:
            self._reap.remove(rec)
            await self._stop_engine(rec, graceful=self.router.outstanding(rec.url) == 0)
        await self._notify()

    async def pushed(self, version: int | str) -> None:
        self.version = version_to_engine(version)
        for u in self.members:
            rec = self.records.get(u)
            if rec is not None and rec.pushed_version is None:
                rec.pushed_version = self.version
        await self._notify()

    # -- operations --------------------------------------------------------------------------
    def _replay(self, kind: str, request: dict[str, Any], key: str | None) -> Operation | None:
        if key is None or key not in self.book._keys:  # noqa: SLF001 - the book's own index
            return None
        return self.book.submit(kind, request, self._timeout(request), key)[0]

    def _check_idle(self) -> None:
        running = self.book.running()
        if running is not None:
            raise Conflict(
                f"operation {running.id} ({running.kind}) is still {running.state.value}; one operation "
                f"runs at a time: wait for it (GET /v1/operations/{running.id}) or cancel it"
            )

    def _timeout(self, request: dict[str, Any]) -> float:
        return float(request.get("timeout_s") or self.operation_timeout_s)

    def _start(self, kind: str, request: dict, key: str | None, body: Callable) -> tuple[Operation, bool]:
        op, created = self.book.submit(kind, request, self._timeout(request), key)
        if created:
            self._tasks[op.id] = asyncio.get_running_loop().create_task(self._drive(op, body))
        return op, created

    async def _drive(self, op: Operation, body: Callable[[Operation, Undo], Awaitable[None]]) -> None:
        undo: Undo = []
        cause = ""
        logger.info("elastic %s %s started: %s", op.kind, op.id, op.request)
        try:
            await asyncio.wait_for(body(op, undo), op.timeout_s)
            logger.info("elastic %s %s %s: %s", op.kind, op.id, op.state.value, op.message)
            return
        except asyncio.CancelledError:
            if not op.cancel_requested:
                raise
            cause = "cancelled on request"
        except asyncio.TimeoutError:
            cause = f"timed out after {op.timeout_s:g}s while {op.state.value}"
        except Exception as e:  # noqa: BLE001 - any failure rolls the operation back
            cause = f"{type(e).__name__}: {e}"
            logger.warning("elastic %s %s failed while %s: %s", op.kind, op.id, op.state.value, e)
        finally:
            self._tasks.pop(op.id, None)
        for step in reversed(undo):
            try:
                await step()
            except Exception:  # noqa: BLE001 - roll back as much as possible
                logger.exception("elastic %s %s: a rollback step failed", op.kind, op.id)
        end = S.CANCELLED if op.cancel_requested else S.FAILED
        op.advance(end, f"{cause}; rolled back", error=None if end is S.CANCELLED else cause)
        # a failed operation is a warning: the console shows it (role processes log INFO to files only)
        level = logging.INFO if end is S.CANCELLED else logging.WARNING
        logger.log(level, "elastic %s %s %s: %s", op.kind, op.id, end.value, cause)

    async def _scale_out(self, op: Operation, undo: Undo) -> None:
        if op.request["mode"] == "ray_native":
            n = int(op.request["num_engines"]) - len(self.records)
            op.advance(S.CREATING, f"starting {n} engine(s)")
            handles = [self.provider.launch() for _ in range(n)]
            undo.append(lambda: self._stop_handles(handles))
            urls = [u.rstrip("/") for u in await asyncio.gather(*(self.provider.url(h) for h in handles))]
            origin = "ray_native"
        else:
            urls = [u.rstrip("/") for u in op.request["engine_urls"]]
            op.advance(S.CONNECTING, f"connecting to {len(urls)} engine(s)")
            handles = [None] * len(urls)
            origin = "external"
        op.engines = urls
        recs = [
            EngineRecord(u, origin, self._next_seq(), "joining", h, added_at=time.time())
            for u, h in zip(urls, handles, strict=True)
        ]
        for rec in recs:
            self.records[rec.url] = rec
            self.clients[rec.url] = EngineClient(rec.url, timeout_s=30.0)
        undo[:] = [lambda: self._discard(recs)]
        if origin == "external":
            await asyncio.gather(*(self.clients[u].health(timeout_s=10.0) for u in urls))
        op.advance(S.HEALTH_CHECKING, "checking that each engine generates")
        await asyncio.gather(*(self.clients[u].health_generate() for u in urls))
        op.advance(S.WEIGHT_SYNCING, "waiting for the next weight push to join the weight-sync group")
        self.desired += urls
        await self._notify()
        async with self._cond:
            await self._cond.wait_for(lambda: all(r.pushed_version or r.join_error for r in recs))
        if failed := [r for r in recs if r.join_error]:
            raise RuntimeError(
                f"{failed[0].url} could not join the weight-sync group: {failed[0].join_error}"
            )
        for rec in recs:
            reported = await self.clients[rec.url].weight_version()
            if reported != rec.pushed_version:
                raise RuntimeError(
                    f"{rec.url} reports weight version {reported} after push {rec.pushed_version}"
                )
        op.cancellable = False  # no await from here on: the engines go live atomically
        for rec in recs:
            rec.state = "active"
            self.router.add_engine(rec.url)
        op.advance(S.ACTIVE, f"{len(recs)} engine(s) serve with weights v{recs[0].pushed_version}")

    async def _scale_in(self, op: Operation, undo: Undo) -> None:
        recs = [self.records[u] for u in op.engines]
        op.advance(S.DRAINING, "no new requests; waiting for in-flight ones")
        for rec in recs:
            rec.state = "draining"
            self.router.remove_engine(rec.url)
        undo.append(lambda: self._restore(recs))
        deadline = time.monotonic() + self.drain_timeout_s
        while any(self.router.outstanding(r.url) for r in recs) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        left = sum(self.router.outstanding(r.url) for r in recs)
        note = f" ({left} requests still in flight are re-sent elsewhere)" if left else ""
        op.advance(S.REMOVING, f"waiting for the next weight push to leave the weight-sync group{note}")
        self.desired = [u for u in self.desired if u not in op.engines]
        async with self._cond:
            await self._cond.wait_for(lambda: not any(r.url in self.members for r in recs))
        op.cancellable = False
        for rec in recs:
            self._forget(rec)
            await self._stop_engine(rec, graceful=self.router.outstanding(rec.url) == 0)
        op.advance(S.COMPLETED, f"removed {len(recs)} engine(s)")

    # -- helpers -----------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def _stop_handles(self, handles: list[Any]) -> None:
        await asyncio.gather(
            *(self.provider.stop(h, graceful=False) for h in handles), return_exceptions=True
        )

    def _forget(self, rec: EngineRecord) -> None:
        self.records.pop(rec.url, None)
        if rec.url in self.desired:
            self.desired.remove(rec.url)

    async def _discard(self, recs: list[EngineRecord]) -> None:
        """Undo a scale-out: out of the router and the plan; stopped now, or after the group re-forms."""
        for rec in recs:
            self.router.remove_engine(rec.url)
            self._forget(rec)
            if rec.url in self.members:
                self._reap.append(rec)
            else:
                await self._stop_engine(rec, graceful=True)

    async def _restore(self, recs: list[EngineRecord]) -> None:
        """Undo a scale-in: engines still in the weight-sync group take traffic again; one that has
        left it (a timeout just after the push) holds old weights, so its removal is finished instead."""
        for rec in recs:
            if rec.url not in self.members:
                self._forget(rec)
                await self._stop_engine(rec, graceful=self.router.outstanding(rec.url) == 0)
                continue
            rec.state = "active"
            self.router.add_engine(rec.url)
            if rec.url not in self.desired:
                self.desired.append(rec.url)

    async def _stop_engine(self, rec: EngineRecord, graceful: bool) -> None:
        client = self.clients.pop(rec.url, None)
        if rec.handle is not None and self.provider is not None:
            await self.provider.stop(rec.handle, graceful=graceful)
        elif client is not None:  # an external engine keeps running; it just leaves our group
            with contextlib.suppress(Exception):
                await client.destroy_weights_update_group(WEIGHT_GROUP)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        """Cancel running operations (they roll back) and stop every engine this manager started."""
        for op_id, task in list(self._tasks.items()):
            self.book.ops[op_id].cancel_requested = True
            task.cancel()
            await asyncio.wait({task})
        for rec in [*self.records.values(), *self._reap]:
            if rec.handle is not None:
                await self._stop_engine(rec, graceful=False)
        for client in self.clients.values():
            await client.close()
