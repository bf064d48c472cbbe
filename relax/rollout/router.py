"""The request router over inference engines (embedded or SGLang; both speak the same protocol).

* **Least outstanding requests**: a request goes to the healthy engine with the fewest requests in
  flight. A prompt group is one request with `n > 1` (its samples share the prompt's prefill on one
  engine); requests that belong to one group but are sent separately carry the same `group_key` and go
  to the engine that served the group first, while it is healthy, so its prefix cache can help.
* **Failures**: an engine that does not answer (refused, timed out, dropped connection, 503) is marked
  unhealthy at once and the request is retried on another engine, from scratch.
* **Health probes**: `probe()` asks every engine for `/health`; an unhealthy engine that answers is taken
  back, so a restarted engine returns to service. `start_health_checks()` probes in the background.
  When no engine is healthy a request probes once; then, where failed engines are being replaced
  (`replacement_wait_s` > 0: the Rollout's embedded engines), it waits that long for an engine to be
  added or to answer again (`waiting` counts such requests: they hold no engine, so a weight update
  need not wait for them), else it gives up.
* **Membership** changes at run time: `add_engine(url)` / `remove_engine(url)`; requests in flight on a
  removed engine finish there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from relax.engine_api.client import EngineClient, EngineRequestError, EngineUnavailableError
from relax.utils import faults
from relax.utils.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.2  # how often a request waiting for an engine looks again
WAIT_PROBE_S = 2.0  # how often it asks the engines for /health meanwhile


class NoHealthyEngineError(RuntimeError):
    """Every engine is down or removed."""


@dataclass
class EngineEntry:
    url: str
    client: EngineClient
    outstanding: int = 0  # requests sent and not yet answered
    healthy: bool = True
    failures: int = 0  # failed calls since the engine was last healthy
    served: int = 0  # requests answered
    unhealthy_since: float = 0.0  # time.monotonic() when it was marked unhealthy


class Router:
    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        probe_timeout_s: float = 5.0,
        max_groups: int = 65536,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the engines' bearer token; None = each engine's own key, derived from this process's
        run token (relax/utils/auth.py: `engine_key`)."""
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.max_retries = max_retries  # other engines tried after a failure
        self.probe_timeout_s = probe_timeout_s
        self.max_groups = max_groups  # group_key -> engine entries remembered (oldest forgotten first)
        self.engines: dict[str, EngineEntry] = {}
        self._groups: OrderedDict[str, str] = OrderedDict()  # group_key -> url
        self._retired: list[EngineEntry] = []  # removed engines whose requests are still in flight
        self._health_task: asyncio.Task | None = None
        # with no engine healthy, how long a request waits for one (0: it fails at once); set where a
        # supervisor replaces failed engines, so a request outlives the engine it was sent to
        self.replacement_wait_s = 0.0
        self.waiting = 0  # requests waiting for an engine now
        for url in urls:
            self.add_engine(url)

    # -- membership --------------------------------------------------------------------------
    def add_engine(self, url: str) -> None:
        url = url.rstrip("/")
        if url not in self.engines:
            self.engines[url] = EngineEntry(
                url, EngineClient(url, timeout_s=self.timeout_s, api_key=self.api_key)
            )
            logger.info("router: engine %s added", url)

    def remove_engine(self, url: str) -> None:
        entry = self.engines.pop(url.rstrip("/"), None)
        if entry is not None:
            self._retired.append(entry)
            logger.info(
                "router: engine %s removed (%d requests in flight finish there)", url, entry.outstanding
            )

    def outstanding(self, url: str) -> int:
        """Requests in flight on `url`, whether it is a member or removed and still finishing them."""
        url = url.rstrip("/")
        entries = [self.engines.get(url), *(e for e in self._retired if e.url == url)]
        return sum(e.outstanding for e in entries if e is not None)

    def urls(self, healthy_only: bool = False) -> list[str]:
        return [u for u, e in self.engines.items() if e.healthy or not healthy_only]

    def status(self) -> list[dict[str, Any]]:
        """One row per engine: url, healthy, outstanding, served, failures."""
        keys = ("url", "healthy", "outstanding", "served", "failures")
        return [{k: getattr(e, k) for k in keys} for e in self.engines.values()]

    def mark_unhealthy(self, url: str, reason: str) -> None:
        entry = self.engines.get(url)
        if entry is not None and entry.healthy:
            entry.healthy, entry.unhealthy_since = False, time.monotonic()
            logger.warning("router: engine %s marked unhealthy: %s", url, reason)

    # -- health ------------------------------------------------------------------------------
    async def probe(self) -> dict[str, bool]:
        """Ask every engine for /health; returns url -> healthy. An answering engine is taken back."""

        async def one(entry: EngineEntry) -> None:
            try:
                await entry.client.health(timeout_s=self.probe_timeout_s)
            except Exception as e:  # noqa: BLE001 - any failure means unhealthy
                self.mark_unhealthy(entry.url, f"health probe failed: {e}")
                return
            if not entry.healthy:
                logger.info("router: engine %s is healthy again", entry.url)
            entry.healthy, entry.failures = True, 0

        await asyncio.gather(*(one(e) for e in list(self.engines.values())))
        return {u: e.healthy for u, e in self.engines.items()}

    def start_health_checks(self, interval_s: float = 5.0) -> None:
        """Probe every `interval_s` seconds in the background (on the running event loop)."""
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop(interval_s))

    async def _health_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.probe()
            except Exception:  # noqa: BLE001 - the checker must outlive one bad round
                logger.exception("router: health probe round failed")

    # -- routing -----------------------------------------------------------------------------
    def _pick(self, exclude: set[str], group_key: str | None) -> EngineEntry | None:
        if group_key is not None and (url := self._groups.get(group_key)) is not None:
            entry = self.engines.get(url)
            if entry is not None and entry.healthy and url not in exclude:
                self._groups.move_to_end(group_key)
                return entry
        candidates = [e for e in self.engines.values() if e.healthy and e.url not in exclude]
        if not candidates:
            return None
        entry = min(candidates, key=lambda e: e.outstanding)
        if group_key is not None:
            self._groups[group_key] = entry.url
            self._groups.move_to_end(group_key)
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        return entry

    async def generate(
        self, input_ids: list[int], sampling_params: dict, *, group_key: str | None = None, **kwargs: Any
    ) -> Any:
        """Send one request (a whole prompt group when `sampling_params['n'] > 1`) to the least loaded
        healthy engine, or to its group's engine; on an engine failure, mark the engine unhealthy and
        retry on another. `kwargs` go to `EngineClient.generate`."""
        tried: set[str] = set()
        probed = False
        deadline: float | None = None  # of the wait for a replacement engine, once one began
        while len(tried) <= self.max_retries:
            entry = self._pick(tried, group_key)
            if entry is None:
                if not probed:
                    probed = True  # every engine looked down: ask again before giving up
                    await self.probe()
                    continue
                if deadline is None:
                    deadline = time.monotonic() + self.replacement_wait_s
                if not await self._wait_for_engine(deadline):
                    break
                tried.clear()  # a replacement, or an engine back in service: a new chance for the request
                continue
            entry.outstanding += 1
            try:
                await faults.apoint("router.request")
                out = await entry.client.generate(input_ids, sampling_params, **kwargs)
            except (EngineUnavailableError, EngineRequestError) as e:
                if isinstance(e, EngineRequestError) and e.status != 503:
                    raise  # the request itself is bad: another engine would refuse it too
                entry.failures += 1
                self.mark_unhealthy(entry.url, str(e))
                tried.add(entry.url)
                logger.warning("router: request failed on %s; retrying elsewhere", entry.url)
                continue
            finally:
                entry.outstanding -= 1
                if entry.outstanding == 0 and entry in self._retired:
                    self._retired.remove(entry)
                    await entry.client.close()
            entry.served += 1
            return out
        waited = f"; waited {self.replacement_wait_s:g}s for a replacement" if deadline is not None else ""
        raise NoHealthyEngineError(
            f"no healthy inference engine could serve the request (tried: {sorted(tried) or 'none'}; "
            f"known: {list(self.engines) or 'none'}{waited}); check the engine processes and their logs"
        )

    async def _wait_for_engine(self, deadline: float) -> bool:
        """Wait until some engine is healthy (added, or answering again); False at `deadline`."""
        self.waiting += 1
        probed_at = time.monotonic()
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(WAIT_POLL_S)
                if any(e.healthy for e in self.engines.values()):
                    return True
                if time.monotonic() - probed_at > WAIT_PROBE_S:
                    probed_at = time.monotonic()
                    await self.probe()
            return False
        finally:
            self.waiting -= 1

    async def close(self) -> None:
        task, self._health_task = self._health_task, None
        await cancel_and_wait(task)
        for entry in [*self.engines.values(), *self._retired]:
            await entry.client.close()
