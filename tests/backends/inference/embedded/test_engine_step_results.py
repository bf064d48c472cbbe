"""When the engine hands a step's finished requests their results: after it has counted the step (so a
caller that scrapes the engine's counters the moment its reply arrives sees its own tokens), and never
not at all, whether the step itself or the handing-out fails."""

from __future__ import annotations

import threading

import pytest

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.scheduling import scheduler as scheduler_module

PARAMS = {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture
def engine(tiny_model_dir):
    eng = EmbeddedEngine(str(tiny_model_dir), device="cpu", dtype="float32", max_running=4, seed=0)
    yield eng.start()
    eng.shutdown()


def test_a_reply_comes_after_its_step_is_counted(engine):
    """Read from the future's callback, which runs as the result is set: the counters already hold the
    request's three tokens and the step that generated the last of them."""
    before = engine.metrics()
    seen: list = []
    called = threading.Event()

    def on_done(_future) -> None:
        seen.append(engine.metrics())
        called.set()

    future = engine.submit([5, 6, 7], PARAMS)
    future.add_done_callback(on_done)
    assert len(future.result(timeout=60)[0].output_ids) == 3
    assert called.wait(timeout=10)
    after = seen[0]
    assert after.generated_tokens_total - before.generated_tokens_total == 3
    assert after.steps_total > before.steps_total
    assert after.busy_seconds_total > before.busy_seconds_total


def test_a_step_that_raises_fails_its_requests_and_the_engine_serves_on(engine, monkeypatch):
    real = engine.scheduler._decode
    calls = {"n": 0}

    def decode_once_broken() -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected decode fault")
        return real()

    monkeypatch.setattr(engine.scheduler, "_decode", decode_once_broken)
    with pytest.raises(RuntimeError, match="engine step failed.*injected decode fault"):
        engine.submit([5, 6, 7], PARAMS).result(timeout=60)
    assert len(engine.submit([5, 6, 7], PARAMS).result(timeout=60)[0].output_ids) == 3


def test_results_that_cannot_be_handed_out_fail_their_requests(engine, monkeypatch):
    """The results of a step's finished requests are handed out after the step: where that raises (here
    the texts' decoding), those requests fail rather than wait forever, and the next ones are served."""
    real = scheduler_module.resolve_groups
    calls = {"n": 0}

    def resolve_once_broken(groups, weight_version) -> None:
        if groups:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected resolve fault")
        real(groups, weight_version)

    monkeypatch.setattr(scheduler_module, "resolve_groups", resolve_once_broken)
    with pytest.raises(RuntimeError, match="engine step failed.*injected resolve fault"):
        engine.submit([5, 6, 7], PARAMS).result(timeout=60)
    assert len(engine.submit([5, 6, 7], PARAMS).result(timeout=60)[0].output_ids) == 3
