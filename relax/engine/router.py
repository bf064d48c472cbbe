"""The request router over inference engines: least outstanding requests, whole prompt groups kept on one
engine (so its prefix cache can serve the group), unhealthy engines skipped and their requests retried
elsewhere, engines added and removed while training runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from relax.backends.inference.client import EngineClient, EngineUnavailableError

logger = logging.getLogger(__name__)


class NoHealthyEngineError(RuntimeError):
    """Every engine is down or removed."""


@dataclass
class EngineEntry:
    url: str
    client: EngineClient
    outstanding: int = 0  # requests sent and not yet answered
    healthy: bool = True
    failures: int = 0  # consecutive failed calls
    unhealthy_since: float = field(default=0.0)


class Router:
    def __init__(self, urls: list[str], *, timeout_s: float = 300.0, max_retries: int = 3) -> None:
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.engines: dict[str, EngineEntry] = {}
        for url in urls:
            self.add_engine(url)

    # -- membership --------------------------------------------------------------------------
    def add_engine(self, url: str) -> None:
        if url not in self.engines:
            self.engines[url] = EngineEntry(url, EngineClient(url, timeout_s=self.timeout_s))
            logger.info("router: engine %s added", url)

    def remove_engine(self, url: str) -> None:
        if self.engines.pop(url, None) is not None:
            logger.info("router: engine %s removed", url)

    def urls(self, healthy_only: bool = False) -> list[str]:
        return [u for u, e in self.engines.items() if e.healthy or not healthy_only]

    def mark_unhealthy(self, url: str, reason: str) -> None:
        entry = self.engines.get(url)
        if entry and entry.healthy:
            entry.healthy, entry.unhealthy_since = False, time.monotonic()
            logger.warning("router: engine %s marked unhealthy: %s", url, reason)

    async def probe(self) -> None:
        """Health-check every engine; an answering engine becomes healthy again."""

        async def one(entry: EngineEntry) -> None:
            try:
                await entry.client.health()
                if not entry.healthy:
                    logger.info("router: engine %s healthy again", entry.url)
                entry.healthy, entry.failures = True, 0
            except Exception as e:  # noqa: BLE001 - any failure means unhealthy
                self.mark_unhealthy(entry.url, str(e))

        await asyncio.gather(*(one(e) for e in list(self.engines.values())))

    # -- routing -----------------------------------------------------------------------------
    def _pick(self, exclude: set[str]) -> EngineEntry:
        candidates = [e for e in self.engines.values() if e.healthy and e.url not in exclude]
        if not candidates:
            raise NoHealthyEngineError(
                f"no healthy inference engine (known: {list(self.engines) or 'none'}); "
                "check the engine processes and their logs"
            )
        return min(candidates, key=lambda e: e.outstanding)

    async def generate(self, input_ids: list[int], sampling_params: dict, **kwargs):
        """Send one request (a whole prompt group when `sampling_params['n'] > 1`) to the least loaded
        engine; on an engine failure, mark it unhealthy and retry on another."""
        tried: set[str] = set()
        for attempt in range(self.max_retries + 1):
            entry = self._pick(tried)
            entry.outstanding += 1
            try:
                return await entry.client.generate(input_ids, sampling_params, **kwargs)
            except EngineUnavailableError as e:
                entry.failures += 1
                self.mark_unhealthy(entry.url, str(e))
                tried.add(entry.url)
                logger.warning("router: retrying request elsewhere (attempt %d)", attempt + 1)
            finally:
                entry.outstanding -= 1
        raise NoHealthyEngineError(f"request failed on every engine tried: {sorted(tried)}")

    async def close(self) -> None:
        for entry in self.engines.values():
            await entry.client.close()
