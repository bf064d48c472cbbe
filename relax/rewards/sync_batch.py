"""Cheap sync rewards in one worker thread per batch, with each call still held to its own timeout.

A sync per-sample reward runs off the event loop, in a worker thread, so a slow or hanging call cannot
stall generation. One thread hop per sample costs the rollout process a future, a lock and a wake-up of
the loop; for a rule reward that itself takes microseconds that was a large share of the Rollout's CPU
(docs/measurements.md). So the scorer learns each reward's cost,
and a reward whose calls take under ``CHEAP_CALL_S`` scores a whole batch in one ``SyncBatch`` job.

The timeout of a call still applies to that call alone: the loop wakes when the call in progress passes
its deadline, abandons the job there (that sample gets the fallback reward; the thread stays busy until
the call returns, as before), and submits the rest of the batch as a new job. Rewards slower than
``CHEAP_CALL_S`` (a sandbox, an HTTP verifier) keep one call per thread, so they still run in parallel.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

CHEAP_CALL_S = 0.002  # a sync reward whose calls average less than this is scored a batch per thread
COST_EMA = 0.2  # weight of the newest call in a reward's running mean cost


class SyncBatch:
    """Calls ``fn(sample, **kwargs)`` on each sample in turn (run it in a worker thread). ``results``
    holds ``(ok, result or exception, seconds)`` per finished call, in order."""

    def __init__(self, fn: Callable[..., Any], samples: list[Any], kwargs: dict[str, Any]) -> None:
        self.fn, self.samples, self.kwargs = fn, samples, kwargs
        self.results: list[tuple[bool, Any, float]] = []
        self._lock = threading.Lock()
        self._started = time.monotonic()  # when the call in progress started
        self._abandoned = False

    def __call__(self) -> None:
        for sample in self.samples:
            with self._lock:
                if self._abandoned:
                    return
                self._started = start = time.monotonic()
            try:
                outcome: tuple[bool, Any] = (True, self.fn(sample, **self.kwargs))
            except (Exception, SystemExit) as e:  # noqa: BLE001 - the scorer decides: fallback, or a setup error
                outcome = (False, e)
            with self._lock:
                if self._abandoned:
                    return
                self.results.append((*outcome, time.monotonic() - start))

    def deadline(self, timeout_s: float) -> float:
        """When the call in progress times out (``time.monotonic`` clock)."""
        with self._lock:
            return self._started + timeout_s

    def abandon_if_late(self, timeout_s: float) -> int | None:
        """Stop the job if its call in progress has run past ``timeout_s``: returns the number of calls
        that finished (the next sample is the one that timed out), or None when it is not late."""
        with self._lock:
            if len(self.results) == len(self.samples) or time.monotonic() - self._started < timeout_s:
                return None
            self._abandoned = True
            return len(self.results)


async def run_batch(
    pool: Executor, fn: Callable[..., Any], samples: list[Any], kwargs: dict[str, Any], timeout_s: float
) -> list[tuple[bool, Any, float] | None]:
    """One outcome per sample, in order: ``(ok, result or exception, seconds)``, or None for a call that
    ran past ``timeout_s``."""
    loop = asyncio.get_running_loop()
    outcomes: list[tuple[bool, Any, float] | None] = []
    while len(outcomes) < len(samples):
        job = SyncBatch(fn, samples[len(outcomes) :], kwargs)
        done = loop.run_in_executor(pool, job)
        while True:
            await asyncio.wait({done}, timeout=max(0.0, job.deadline(timeout_s) - time.monotonic()))
            if done.done():
                done.result()
                outcomes += job.results
                break
            finished = job.abandon_if_late(timeout_s)
            if finished is not None:
                outcomes += [*job.results[:finished], None]
                break
    return outcomes


class CallCost:
    """The running mean duration of each reward's calls, to pick how its sync calls are scheduled."""

    def __init__(self) -> None:
        self._mean: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        old = self._mean.get(name)
        self._mean[name] = seconds if old is None else (1 - COST_EMA) * old + COST_EMA * seconds

    def cheap(self, name: str) -> bool:
        """Whether ``name``'s calls are known to be cheap (unknown until it has been called)."""
        return self._mean.get(name, float("inf")) < CHEAP_CALL_S
