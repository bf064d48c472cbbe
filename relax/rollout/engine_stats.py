"""The engines' own counters in the run's metrics: each step, the Rollout scrapes every engine's Prometheus
`/metrics` and records what changed since the last step.

* `rollout/engine_cache_hit_rate`: prompt tokens served by the prefix cache / prompt tokens looked up over
  the step, all engines together (`relax:prefix_cache_hit_tokens` / `relax:prefix_cache_lookup_tokens`;
  an engine that only reports SGLang's cumulative `sglang:cache_hit_rate` contributes that instead);
* `rollout/engine_preempted`: running requests the engines preempted for want of KV memory over the step
  (`relax:preempted_requests`), each recomputed later; a steady number here says the KV ceiling
  (`rollout.engine_max_total_tokens`, `rollout.engine_kv_memory_fraction`) is too low for the workload;
* `rollout/engine_busy_s`: seconds an engine spent inside its steps over the step, the mean over the
  engines (`relax:engine_busy_seconds`); against `perf/rollout_s` it says how much of the rollout the
  engines were generating, and how much went to everything around them (requests, rewards, transfers);
* `rollout/engine_step_ms`: the mean engine step over the step (busy seconds / `relax:engine_steps`), all
  engines together; at a full batch it is the decode step that `benchmarks/engine.py` times alone;
* `rollout/engine_busy_tok_s`: tokens generated per busy engine-second (`sglang:generation_tokens`).

The three engine-time figures need a Relax engine (SGLang's `/metrics` has no busy time); a step in which
no engine ran a step leaves them out.

A scrape that fails or takes longer than `SCRAPE_TIMEOUT_S` leaves that engine out of the step's figures:
these are observations, and a slow engine must not hold up or fail a step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
COUNTERS = {  # sample name in the exposition -> key here
    "relax:prefix_cache_hit_tokens_total": "hit",
    "relax:prefix_cache_lookup_tokens_total": "lookup",
    "relax:preempted_requests_total": "preempted",
    "relax:engine_busy_seconds_total": "busy",
    "relax:engine_steps_total": "steps",
    "sglang:generation_tokens_total": "generated",
}
CUMULATIVE_HIT_RATE = "sglang:cache_hit_rate"


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The counters above (and SGLang's cumulative hit rate) from one Prometheus exposition."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                out[COUNTERS[sample.name]] = out.get(COUNTERS[sample.name], 0.0) + sample.value
            elif sample.name == CUMULATIVE_HIT_RATE:
                out["hit_rate"] = sample.value
    return out


class EngineStats:
    """Per-step deltas of the engines' counters (one object per Rollout, keyed by engine URL)."""

    def __init__(self) -> None:
        self._last: dict[str, dict[str, float]] = {}

    async def step_metrics(self, engines: Iterable[tuple[str, Any]]) -> dict[str, float]:
        """`engines`: (url, client with `metrics_text()`) pairs. The step's figures; {} if none answered."""
        engines = list(engines)
        texts = await asyncio.gather(*(self._scrape(c) for _, c in engines))
        hit = lookup = preempted = busy = steps = generated = 0.0
        timed = 0  # engines that report their busy time
        rates: list[float] = []
        answered = False
        for (url, _), text in zip(engines, texts, strict=True):
            if text is None:
                continue
            now = parse_engine_metrics(text)
            answered = True
            last = self._last.get(url, {})
            # a restarted engine counts from zero again (the counters only; SGLang's hit rate is a ratio)
            if any(now.get(k, 0.0) < last.get(k, 0.0) for k in COUNTERS.values()):
                last = {}
            self._last[url] = now
            if "lookup" in now:
                hit += now.get("hit", 0.0) - last.get("hit", 0.0)
                lookup += now["lookup"] - last.get("lookup", 0.0)
            elif "hit_rate" in now:
                rates.append(now["hit_rate"])
            preempted += max(now.get("preempted", 0.0) - last.get("preempted", 0.0), 0.0)
            if "busy" in now:
                timed += 1
                busy += now["busy"] - last.get("busy", 0.0)
                steps += now.get("steps", 0.0) - last.get("steps", 0.0)
                generated += now.get("generated", 0.0) - last.get("generated", 0.0)
        if not answered:
            return {}
        out = {"rollout/engine_preempted": preempted}
        if steps > 0 and busy > 0:
            out["rollout/engine_busy_s"] = busy / timed
            out["rollout/engine_step_ms"] = 1e3 * busy / steps
            out["rollout/engine_busy_tok_s"] = generated / busy
        if lookup > 0:
            out["rollout/engine_cache_hit_rate"] = hit / lookup
        elif rates:
            out["rollout/engine_cache_hit_rate"] = sum(rates) / len(rates)
        return out

    @staticmethod
    async def _scrape(client: Any) -> str | None:
        try:
            return await asyncio.wait_for(client.metrics_text(), SCRAPE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - an observation: a failed scrape only drops this engine
            logger.debug("engine metrics scrape failed: %r", e)
            return None
