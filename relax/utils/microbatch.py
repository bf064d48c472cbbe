"""Gathering concurrent requests into batches: one ``run_batch`` call for many callers.

``MicroBatcher(run_batch, max_items, wait_s)``: each caller ``await submit(items)`` with a list of items
and gets back the results of its own items, in order. A batch is sent when it holds ``max_items`` items
or ``wait_s`` seconds after its first request, whichever comes first; a request is never split, so a
single request larger than ``max_items`` is sent alone. ``run_batch`` must return one result per item;
if it raises, every caller of that batch gets the error.

(Ray Serve's ``@serve.batch`` does this inside a replica only; this one also runs in plain asyncio code
and unit tests, and counts items rather than requests.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    """Coalesces ``submit`` calls of one event loop into ``run_batch`` calls of at most ``max_items``."""

    def __init__(
        self, run_batch: Callable[[list[T]], Awaitable[list[R]]], max_items: int, wait_s: float
    ) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.run_batch = run_batch
        self.max_items = max_items
        self.wait_s = wait_s
        self._pending: list[tuple[list[T], asyncio.Future]] = []  # requests of the batch being filled
        self._pending_items = 0
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()  # batches in flight (kept referenced)
        self.batch_sizes: list[int] = []  # items per batch sent, most recent last (bounded)

    async def submit(self, items: list[T]) -> list[R]:
        """Results for ``items``, computed in a batch with other callers' items."""
        if not items:
            return []
        loop = asyncio.get_running_loop()
        if self._pending_items and self._pending_items + len(items) > self.max_items:
            self._flush()  # this request would overflow the batch being filled: send that one first
        future: asyncio.Future = loop.create_future()
        self._pending.append((list(items), future))
        self._pending_items += len(items)
        if self._pending_items >= self.max_items:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending:
            return
        pending, self._pending, self._pending_items = self._pending, [], 0
        task = asyncio.get_running_loop().create_task(self._run(pending))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, pending: list[tuple[list[T], asyncio.Future]]) -> None:
        items = [item for request, _ in pending for item in request]
        self.batch_sizes = [*self.batch_sizes[-99:], len(items)]
        try:
            results = await self.run_batch(items)
            if len(results) != len(items):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(items)} items")
        except Exception as e:  # noqa: BLE001 - handed to every caller of this batch
            for _, future in pending:
                if not future.done():
                    future.set_exception(e)
            return
        start = 0
        for request, future in pending:
            if not future.done():  # a caller may have been cancelled
                future.set_result(results[start : start + len(request)])
            start += len(request)

    def stats(self) -> dict[str, Any]:
        """Recent batch sizes (for logs and tests)."""
        return {"batches": len(self.batch_sizes), "recent_sizes": list(self.batch_sizes)}
