"""Prometheus metrics of the embedded engine, read from the engine at scrape time.

Names follow SGLang's (`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:gen_throughput`,
`sglang:token_usage`, ...) so a dashboard or router reading SGLang engines reads these unchanged;
`relax:engine_info` adds the weight version and model as labels.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from relax.backends.inference.embedded.engine import EmbeddedEngine

logger = logging.getLogger(__name__)


class EngineCollector(Collector):
    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine

    def collect(self):  # -> Iterator[Metric]
        m = self.engine.metrics()
        labels = ["model_name"]
        model = [self.engine.runner.model_path]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(model, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(model, value)
            return c

        yield gauge("sglang:num_running_reqs", "Sequences in the running batch.", m.num_running)
        yield gauge("sglang:num_queue_reqs", "Sequences waiting for admission.", m.num_waiting)
        yield gauge("sglang:gen_throughput", "Generated tokens per second (last 5 s).", m.gen_throughput)
        yield gauge("sglang:num_used_tokens", "Tokens held in the KV cache.", m.kv_tokens)
        yield gauge("sglang:max_total_num_tokens", "KV cache capacity in tokens.", m.kv_capacity)
        yield gauge("sglang:token_usage", "KV cache usage: tokens held / capacity.", m.kv_usage)
        yield gauge(
            "sglang:cache_hit_rate",
            "Prefix cache hit rate: prompt tokens served from the cache / prompt tokens looked up.",
            m.cache_hit_rate,
        )
        yield counter(
            "relax:prefill_computed_tokens",
            "Prompt tokens prefilled (once per prompt).",
            m.prefill_tokens_computed,
        )
        yield gauge("relax:prefix_cache_tokens", "Tokens held by the prefix cache.", m.prefix_cache_tokens)
        yield counter(
            "relax:prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache.", m.prefix_hit_tokens
        )
        yield counter(
            "relax:prefix_cache_lookup_tokens",
            "Prompt tokens looked up in the prefix cache.",
            m.prefix_lookup_tokens,
        )
        yield counter(
            "relax:preempted_requests",
            "Running sequences preempted for want of KV blocks (recomputed when readmitted).",
            m.preempted_total,
        )
        yield counter(
            "relax:engine_busy_seconds",
            "Wall seconds the engine spent inside its steps (prefill and decode; idle waits and commands "
            "such as weight updates left out).",
            m.busy_seconds_total,
        )
        yield counter(
            "relax:engine_steps", "Engine steps run (each a prefill, a decode or both).", m.steps_total
        )
        yield gauge("relax:engine_paused", "1 while generation is paused.", float(m.paused))
        yield counter("sglang:generation_tokens", "Generated tokens.", m.generated_tokens_total)
        yield counter("sglang:prompt_tokens", "Prompt tokens received (times n).", m.prompt_tokens_total)
        yield counter("sglang:num_requests", "Requests received.", m.requests_total)
        info = GaugeMetricFamily(
            "relax:engine_info", "Engine identity.", labels=["model_name", "weight_version"]
        )
        info.add_metric([*model, m.weight_version], 1.0)
        yield info


def render_metrics(engine: EmbeddedEngine) -> tuple[bytes, str]:
    """The Prometheus text exposition of `engine`'s metrics and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return generate_latest(registry), CONTENT_TYPE_LATEST
