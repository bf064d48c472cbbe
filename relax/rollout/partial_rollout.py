"""Generation across weight updates: every request goes through `InflightRequests`, so that a weight
update can wait for in-flight generation to end (default), or, with partial rollout, either

* `abort` it: the unfinished samples are resumed under the new weights by a new request (prompt and
  tokens so far prefilled again, so their KV cache comes from the new weights). A sample already aborted
  `max_aborts` times is not aborted again: the update waits for it instead.
* or keep it `in_place`: the running requests keep their KV cache and continue under the new weights,
  which the engines load between two decode steps. Nothing is prefilled again and no request is
  repeated; the tokens before the update keep the KV cache of the old weights (the in-flight weight
  update of PipelineRL). Engines that load a push between two steps on their own (`live_weight_updates`
  in `/get_model_info`: the embedded engine) keep generating through the push, new requests included;
  the others (SGLang) are paused in place for it. Embedded engines report where each version began
  (`weight_version_starts`).

A sample keeps the tokens and behaviour log-probs it had (they came from the old weights), gets the rest
from the new weights, and records every version in `weight_versions`. With `rollout.mask_offpolicy_tokens`
the tokens generated before the last abort or in-place update get loss mask 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from relax.engine_api.protocol import version_from_engine
from relax.rollout.router import Router

logger = logging.getLogger(__name__)

_rids = itertools.count()
IDLE_POLL_S = 0.5  # how often a weight update looks again at requests waiting for an engine


@dataclass
class Generated:
    """One sample's generation so far, possibly over several requests."""

    output_ids: list[int] = field(default_factory=list)  # [R] tokens so far
    log_probs: list[float] = field(default_factory=list)  # [R] behaviour log-probs, each under its version
    finish_reason: str = "abort"  # of the last request: stop | length | abort
    weight_versions: list[int] = field(default_factory=list)  # one per request segment, oldest first
    aborts: int = 0  # times a weight update interrupted this sample
    offpolicy_len: int = 0  # tokens generated before the last abort
    text: str = ""

    def extend(self, out: Any) -> None:
        before = len(self.output_ids)
        self.output_ids += list(out.output_ids)
        self.log_probs += list(out.output_log_probs)
        self.finish_reason = out.finish_reason
        versions = getattr(out, "weight_versions", None) or [out.weight_version]
        for v in map(version_from_engine, versions):
            if not self.weight_versions or self.weight_versions[-1] != v:
                self.weight_versions.append(v)
        starts = getattr(out, "weight_version_starts", None) or []
        if len(versions) > 1 and len(starts) == len(versions):  # updated in place while it ran
            self.offpolicy_len = before + int(starts[-1])
        self.text = out.text if self.aborts == 0 else ""  # re-decoded by the caller after a resume


class InflightRequests:
    """All generation requests of the Rollout role; the gate a weight update closes and opens."""

    def __init__(
        self, router: Router, *, partial: bool = False, max_aborts: int = 2, partial_mode: str = "abort"
    ) -> None:
        if partial_mode not in ("abort", "in_place"):
            raise ValueError(f"unknown partial rollout mode {partial_mode!r}; use abort or in_place")
        self.router = router
        self.partial = partial
        self.in_place = partial and partial_mode == "in_place"
        self.max_aborts = max_aborts
        self._paused: list[Any] = []  # engine clients paused in place for the update in progress
        self._live: dict[str, bool] = {}  # engine URL -> loads a push between two steps without a pause
        self.inflight: dict[str, int] = {}  # rid -> fewest aborts among its samples
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Condition()
        self.num_aborted = 0  # requests aborted by updates (a metric)

    async def generate(
        self,
        prompt_ids: list[int],
        params: dict[str, Any],
        aborts: int = 0,
        multimodal_inputs: dict[str, Any] | None = None,
        **client_kwargs: Any,
    ) -> list[Any]:
        """One request (`n` samples of one prompt, with its media tensors if any); waits while a weight
        update is in progress. `client_kwargs` go to `EngineClient.generate` (streaming, top log-probs)."""
        await self._open.wait()
        rid = f"relax-{next(_rids)}"
        self.inflight[rid] = aborts
        try:
            media = {"multimodal_inputs": multimodal_inputs} if multimodal_inputs else {}
            out = await self.router.generate(prompt_ids, params, rid=rid, **media, **client_kwargs)
        finally:
            self.inflight.pop(rid, None)
            async with self._idle:
                self._idle.notify_all()
        return out if isinstance(out, list) else [out]

    async def begin_update(self) -> None:
        """Close the gate; then pause the engines in place, or abort what may be aborted (partial
        rollout) and wait for the rest to end. In place, engines that load a push without a pause are
        left generating, and when all are, the gate stays open: a push then stops nothing (a pause and
        resume would hold fully_async's weight push, which paces its steps; docs/measurements.md)."""
        if self.in_place:
            clients = [entry.client for entry in self.router.engines.values()]
            live = await asyncio.gather(*(self._loads_live(c) for c in clients))
            pause = [c for c, ok in zip(clients, live, strict=True) if not ok]
            if pause:
                self._open.clear()
                await self._pause_engines(pause)
            return
        self._open.clear()
        if self.partial:
            rids = [rid for rid, a in self.inflight.items() if a < self.max_aborts]
            clients = [entry.client for entry in self.router.engines.values()]
            if rids and len(rids) == len(self.inflight):
                # Everything in flight may be aborted: one `abort_all` per engine instead of one call per
                # request and engine (a step's dozens of aborts held the weight push for tens of ms). The
                # engines are this role's own; nothing else generates on them during a push.
                await asyncio.gather(*(c.abort(abort_all=True) for c in clients))
            else:  # some samples are at the abort cap and must finish: abort the others one by one
                await asyncio.gather(*(c.abort(rid) for rid in rids for c in clients))
            self.num_aborted += len(rids)
        # Requests waiting in the router for a replacement engine hold none: they start on an engine
        # with the new weights after the update. They change state unannounced, hence the timeout.
        async with self._idle:
            while len(self.inflight) > getattr(self.router, "waiting", 0):  # a fake router has none
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), IDLE_POLL_S)

    async def _loads_live(self, client: Any) -> bool:
        """Whether the engine loads a push between two steps while it generates (asked once per URL; an
        engine that does not say so, or does not answer, is paused)."""
        url = getattr(client, "base_url", None)
        if url not in self._live:
            try:
                info = await client.model_info()
            except Exception:  # noqa: BLE001 - a fake, or an engine that is down: pause it (asked again)
                return False
            self._live[url] = bool(info.get("live_weight_updates"))
        return self._live[url]

    async def _pause_engines(self, clients: list[Any]) -> None:
        """Pause engines between two steps, keeping their requests and KV cache. An engine that does
        not answer is left to the router and the health checks (its requests are retried elsewhere);
        the push goes on with the others."""
        results = await asyncio.gather(*(c.pause("in_place") for c in clients), return_exceptions=True)
        for c, r in zip(clients, results, strict=True):
            if isinstance(r, BaseException):
                logger.warning("could not pause %s for the weight update: %s", c.base_url, r)
            else:
                self._paused.append(c)

    async def end_update(self) -> None:
        """Open the gate (and continue the engines paused in place)."""
        paused, self._paused = self._paused, []
        results = await asyncio.gather(*(c.resume() for c in paused), return_exceptions=True)
        for c, r in zip(paused, results, strict=True):
            if isinstance(r, BaseException):
                logger.warning("could not continue %s after the weight update: %s", c.base_url, r)
        self._open.set()

    async def generate_group(
        self, prompt_ids: list[int], params: dict[str, Any], multimodal_inputs: dict[str, Any] | None = None
    ) -> list[Generated]:
        """`params['n']` samples of one prompt, each completed across any weight updates."""
        first = await self.generate(prompt_ids, params, multimodal_inputs=multimodal_inputs)
        results = []
        for out in first:
            g = Generated()
            g.extend(out)
            results.append(g)
        if self.partial:
            await asyncio.gather(*(self._resume(prompt_ids, params, g, multimodal_inputs) for g in results))
        return results

    async def _resume(
        self, prompt_ids: list[int], params: dict[str, Any], g: Generated, media: dict[str, Any] | None = None
    ) -> None:
        cap = int(params["max_new_tokens"])
        while g.finish_reason == "abort" and not self.router_closed():
            g.aborts += 1
            g.offpolicy_len = len(g.output_ids)
            left = cap - len(g.output_ids)
            if left <= 0:
                g.finish_reason = "length"
                return
            cont = {**params, "n": 1, "max_new_tokens": left}
            (out,) = await self.generate(
                prompt_ids + g.output_ids, cont, aborts=g.aborts, multimodal_inputs=media
            )
            g.extend(out)

    def router_closed(self) -> bool:
        return not self.router.engines
