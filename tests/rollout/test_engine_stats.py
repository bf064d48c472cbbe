"""The engines' prefix-cache hits and preemptions as per-step run metrics, scraped from `/metrics`."""

from __future__ import annotations

import asyncio
import random

import pytest

from relax.rollout import engine_stats
from relax.rollout.engine_stats import EngineStats, parse_engine_metrics


def run(coro):
    return asyncio.run(coro)


def test_a_step_reports_the_hits_of_its_own_requests(engine_server, client):
    """Scraped from the session's engine server: the second request with the same 40-token prompt finds
    its two full blocks cached, and the step's hit rate counts only the requests since the last scrape."""
    stats = EngineStats()
    engines = [(engine_server.url, client)]
    # the baseline: whatever the session's other tests sent (its cumulative hit rate falls with the two
    # requests below, which must not read as a restarted engine's counters)
    assert run(stats.step_metrics(engines))
    vocab = engine_server.engine.runner.vocab_size
    prompt = random.Random().sample(range(8, vocab), 40)  # no other test's prefix
    params = {"max_new_tokens": 2, "ignore_eos": True}
    run(client.generate(prompt, params))
    run(client.generate(prompt, params))
    step = run(stats.step_metrics(engines))
    assert step["rollout/engine_preempted"] == 0
    # 80 tokens looked up; the second request finds the first's two full blocks (its last token is
    # always computed)
    assert step["rollout/engine_cache_hit_rate"] == pytest.approx(32 / 80)
    # the engine's own time: two tokens each, generated in at least one step of positive length
    assert step["rollout/engine_busy_s"] > 0
    assert step["rollout/engine_busy_tok_s"] * step["rollout/engine_busy_s"] == pytest.approx(4)
    assert 0 < step["rollout/engine_step_ms"] <= 1e3 * step["rollout/engine_busy_s"]
    again = run(stats.step_metrics(engines))
    assert "rollout/engine_cache_hit_rate" not in again  # nothing looked up since
    assert "rollout/engine_busy_s" not in again  # nor any step run


class Fake:
    def __init__(self, texts):
        self.texts = list(texts)

    async def metrics_text(self) -> str:
        text = self.texts.pop(0)
        if text is None:
            await asyncio.sleep(3600)  # an engine that does not answer
        if isinstance(text, Exception):
            raise text
        return text


def exposition(hit: float, lookup: float, preempted: float) -> str:
    """A Relax engine's counters, with SGLang's cumulative hit rate beside them (as /metrics has it)."""
    return (
        f'relax:prefix_cache_hit_tokens_total{{model_name="m"}} {hit}\n'
        f'relax:prefix_cache_lookup_tokens_total{{model_name="m"}} {lookup}\n'
        f'relax:preempted_requests_total{{model_name="m"}} {preempted}\n'
        f'sglang:cache_hit_rate{{model_name="m"}} {hit / lookup if lookup else 0.0}\n'
    )


def test_deltas_over_engines_a_restart_and_engines_that_fail_or_hang(monkeypatch):
    monkeypatch.setattr(engine_stats, "SCRAPE_TIMEOUT_S", 0.2)
    a = Fake([exposition(10, 100, 1), exposition(40, 200, 4), exposition(41, 300, 4), exposition(5, 10, 0)])
    b = Fake([exposition(0, 0, 0), ConnectionError("refused"), None, exposition(0, 0, 0)])
    stats = EngineStats()
    engines = [("http://a", a), ("http://b", b)]
    run(stats.step_metrics(engines))
    # a: 30 of 100 hit, 3 preempted; b refused the scrape and is left out of the step
    assert run(stats.step_metrics(engines)) == {
        "rollout/engine_preempted": 3.0,
        "rollout/engine_cache_hit_rate": 0.3,
    }
    # a: 1 of 100 (its cumulative rate fell from 0.2 to 0.137, which is no restart); b hangs, left out
    assert run(stats.step_metrics(engines)) == {
        "rollout/engine_preempted": 0.0,
        "rollout/engine_cache_hit_rate": pytest.approx(0.01),
    }
    # a restarted (its counters fell): counted from zero
    assert run(stats.step_metrics(engines)) == {
        "rollout/engine_preempted": 0.0,
        "rollout/engine_cache_hit_rate": 0.5,
    }
    assert run(EngineStats().step_metrics([("http://c", Fake([OSError("down")]))])) == {}


def test_an_sglang_engine_reports_its_cumulative_hit_rate():
    text = 'sglang:cache_hit_rate{model_name="m"} 0.75\nsglang:num_running_reqs{model_name="m"} 3\n'
    assert parse_engine_metrics(text) == {"hit_rate": 0.75}
    step = run(EngineStats().step_metrics([("http://s", Fake([text]))]))
    assert step == {"rollout/engine_preempted": 0.0, "rollout/engine_cache_hit_rate": 0.75}


def busy(seconds: float, steps: float, generated: float) -> str:
    return (
        f'relax:engine_busy_seconds_total{{model_name="m"}} {seconds}\n'
        f'relax:engine_steps_total{{model_name="m"}} {steps}\n'
        f'sglang:generation_tokens_total{{model_name="m"}} {generated}\n'
    )


def test_the_engines_busy_time_is_the_mean_over_the_engines_that_report_it():
    """Two Relax engines and an SGLang one (no busy time): busy seconds are the mean of the two, the step
    and the token rate pooled over their steps and seconds; a restart counts from zero."""
    a = Fake([busy(1.0, 100, 1000), busy(3.0, 300, 26_000), busy(0.5, 50, 1000)])
    b = Fake([busy(0.0, 0, 0), busy(1.0, 200, 9000), busy(2.0, 400, 19_000)])
    s = Fake([exposition(0, 0, 0) + 'sglang:generation_tokens_total{model_name="m"} 7\n'] * 3)
    stats = EngineStats()
    engines = [("http://a", a), ("http://b", b), ("http://s", s)]
    run(stats.step_metrics(engines))
    step = run(stats.step_metrics(engines))
    # a: 2 s, 200 steps, 25,000 tokens; b: 1 s, 200 steps, 9,000 tokens
    assert step["rollout/engine_busy_s"] == pytest.approx(1.5)
    assert step["rollout/engine_step_ms"] == pytest.approx(1e3 * 3.0 / 400)
    assert step["rollout/engine_busy_tok_s"] == pytest.approx(34_000 / 3.0)
    step = run(stats.step_metrics(engines))  # a restarted: its 0.5 s from zero; b 1 s more
    assert step["rollout/engine_busy_s"] == pytest.approx(0.75)
    assert step["rollout/engine_step_ms"] == pytest.approx(1e3 * 1.5 / 250)
    assert step["rollout/engine_busy_tok_s"] == pytest.approx(11_000 / 1.5)
