"""The overlapped decode loop (each step launched before the last is read back; on by default on CUDA)
gives the same tokens as one step at a time. Forced on here on the CPU too, where the bookkeeping is the same:
rows that finish while the next step is in flight, the batch re-gathered in its new order, admission and
commands that wait for the step in flight."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch

from relax.backends.inference.embedded.engine import EmbeddedEngine

PROMPTS = [[(7 * i + j) % 500 + 1 for j in range(3 + i % 5)] for i in range(10)]


def _requests(stop_id: int) -> list[dict]:
    """Seeded sampled and greedy rows, lengths that end at different steps, n > 1, a stop token."""
    reqs = []
    for i in range(len(PROMPTS)):
        params = {"max_new_tokens": 2 + 3 * i, "ignore_eos": True}
        if i % 3 == 0:
            params |= {"temperature": 0.0}
        else:
            params |= {"temperature": 0.7 + 0.1 * i, "sampling_seed": 100 + i}
        if i == 4:
            params |= {"n": 3}
        if i == 5:
            params |= {"stop_token_ids": [stop_id], "temperature": 0.0, "max_new_tokens": 24}
        reqs.append(params)
    return reqs


def _run(
    engine: EmbeddedEngine, reqs: list[dict], waves: int = 2
) -> list[list[tuple[list[int], list[float]]]]:
    """Submit in `waves`, each once the last is running; returns each request's samples."""
    futures = []
    per_wave = -(-len(reqs) // waves)
    for w in range(waves):
        part = range(w * per_wave, min(len(reqs), (w + 1) * per_wave))
        futures += [engine.submit(PROMPTS[i], reqs[i]) for i in part]
        if w + 1 < waves:
            engine.generate([3, 4], {"max_new_tokens": 2, "temperature": 0.0})  # a few steps pass
    return [[(o.output_ids, o.output_logprobs) for o in f.result(timeout=60)] for f in futures]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=CUDA)])
def engines(tiny_model_dir, request):
    kw = dict(device=request.param, dtype="float32", max_running=8, seed=0)
    plain = EmbeddedEngine(str(tiny_model_dir), overlap=False, **kw).start()
    overlap = EmbeddedEngine(str(tiny_model_dir), overlap=True, **kw).start()
    assert overlap.scheduler.overlap and not plain.scheduler.overlap
    yield plain, overlap
    plain.shutdown()
    overlap.shutdown()


def test_overlapped_steps_give_the_same_tokens(engines):
    plain, overlap = engines
    greedy = plain.generate(PROMPTS[5], {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True})
    stop_id = greedy[0].output_ids[6]  # the stop row ends mid-batch, at a step no length predicts
    reqs = _requests(stop_id)
    want = _run(plain, reqs)
    got = _run(overlap, reqs)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert [ids for ids, _ in g] == [ids for ids, _ in w], f"request {i}"
        for (_, lw), (_, lg) in zip(w, g, strict=True):
            assert lg == pytest.approx(lw, abs=1e-4), f"request {i}"
    assert got[5][0][0][-1] == stop_id and len(got[5][0][0]) <= 7
    assert [len(s[0]) for s in got[3]] == [reqs[3]["max_new_tokens"]]
    assert overlap.scheduler.inflight is None and not overlap.scheduler.running  # nothing left behind


def test_an_abort_while_a_step_is_in_flight_leaves_the_others_intact(engines):
    plain, overlap = engines
    params = {"max_new_tokens": 40, "temperature": 1.0, "ignore_eos": True}
    seeded = [{**params, "sampling_seed": 7 + i} for i in range(4)]
    want = [plain.generate(PROMPTS[i], seeded[i])[0].output_ids for i in range(4)]
    overlap.step_sleep_s = 0.005  # the abort lands mid-run
    try:
        victim = overlap.submit(PROMPTS[9], {**params, "max_new_tokens": 400}, rid="victim")
        futures = [overlap.submit(PROMPTS[i], seeded[i]) for i in range(4)]
        while not overlap.scheduler.running:
            pass
        assert overlap.abort("victim") == 1
        assert victim.result(timeout=60)[0].finish_reason["type"] == "abort"
        assert [f.result(timeout=60)[0].output_ids for f in futures] == want
    finally:
        overlap.step_sleep_s = 0.0


@contextlib.contextmanager
def running(engine: EmbeddedEngine, prompt: list[int], max_new_tokens: int) -> Iterator[Future]:
    """A greedy request, slowed to 5 ms a step, once the engine runs it; the engine's speed is restored
    on the way out."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    engine.step_sleep_s = 0.005
    try:
        fut = engine.submit(prompt, params)
        while len(engine.scheduler.running) == 0:
            pass
        yield fut
    finally:
        engine.step_sleep_s = 0.0


def test_pause_in_place_and_a_weight_update_see_no_step_in_flight(engines):
    _, overlap = engines
    with running(overlap, PROMPTS[1], 30) as fut:
        overlap.pause("in_place")
        assert overlap.scheduler.inflight is None
        done = len(overlap.scheduler.running[0].output_ids)
        version = overlap.weight_version
        overlap.update_weights([], weight_version=f"{version}-next")
        overlap.resume()
        out = fut.result(timeout=60)[0]
    assert len(out.output_ids) == 30
    # every token read back before the pause counts under the old version, none after it
    assert out.weight_versions == [version, f"{version}-next"]
    assert out.weight_version_starts == [0, done]


def _prefill_sizes(engine: EmbeddedEngine) -> list[int]:
    sizes: list[int] = []
    inner = engine.runner.prefill

    def prefill(prompts, slots):
        sizes.append(len(prompts))
        return inner(prompts, slots)

    engine.runner.prefill = prefill
    return sizes


def test_an_idle_engine_prefills_a_burst_together(tiny_model_dir):
    import time

    engine = EmbeddedEngine(str(tiny_model_dir), device="cpu", dtype="float32", max_running=32, seed=0)
    engine.burst_gap_s, engine.burst_max_s = 0.05, 5.0  # generous: a loaded machine may stall a thread
    sizes = _prefill_sizes(engine)
    engine.start()
    try:
        params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
        futures = []
        for i in range(10):  # a request every 5 ms: one burst
            futures.append(engine.submit(PROMPTS[i], params))
            time.sleep(0.005)
        [f.result(timeout=60) for f in futures]
        assert sizes == [10]
        engine.burst_max_s = 0.03  # the wait is bounded: a longer trickle is taken in parts
        sizes.clear()
        futures = []
        for i in range(10):
            futures.append(engine.submit(PROMPTS[i], params))
            time.sleep(0.01)
        [f.result(timeout=60) for f in futures]
        assert len(sizes) > 1 and sum(sizes) == 10
    finally:
        engine.shutdown()


def test_gathering_a_burst_ends_once_the_queue_fills_a_step(tiny_model_dir):
    """The burst window waits for a batch to arrive, not for requests that one step cannot take: with
    room for 4 rows, the engine starts once a fifth request waits, while the rest still trickle in."""
    import time

    engine = EmbeddedEngine(str(tiny_model_dir), device="cpu", dtype="float32", max_running=4, seed=0)
    engine.burst_gap_s, engine.burst_max_s = 0.05, 30.0  # the trickle below never pauses for 50 ms
    futures: list = []
    seen: list[int] = []  # requests submitted when each prefill ran
    inner = engine.runner.prefill
    engine.runner.prefill = lambda prompts, slots: seen.append(len(futures)) or inner(prompts, slots)
    engine.start()
    try:
        params = {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}
        for i in range(16):
            futures.append(engine.submit(PROMPTS[i % len(PROMPTS)], params))
            time.sleep(0.02)
        [f.result(timeout=60) for f in futures]
        assert seen and seen[0] < 16, seen  # the first prefill did not wait for the whole trickle
    finally:
        engine.shutdown()


def test_a_push_while_generating_is_held_until_its_last_bucket(engines):
    """A push that arrives while the engine generates needs no pause: a bucket before the last is
    checked and held, and the last loads every bucket in one command between two steps, so no step runs
    on a mix of two versions. While paused, a bucket loads at once."""
    plain, _ = engines
    runner = plain.runner
    first, last = "model.embed_tokens.weight", "lm_head.weight"
    before = {n: runner._params[n].detach().clone() for n in (first, last)}
    with running(plain, PROMPTS[2], 40) as fut:
        version = plain.weight_version
        with pytest.raises(KeyError, match="unknown weight"):  # a bad bucket fails when it comes
            plain.update_weights([("no.such.weight", torch.zeros(1))], refresh=False)
        plain.update_weights([(first, before[first] + 1.0)], refresh=False)
        assert plain.weight_version == version  # held: nothing loaded yet
        assert torch.equal(runner._params[first].detach(), before[first])
        plain.update_weights([(last, before[last] + 1.0)], weight_version=f"{version}-b", refresh=True)
        assert plain.weight_version == f"{version}-b"
        for n in (first, last):
            assert torch.equal(runner._params[n].detach(), before[n] + 1.0)
        plain.pause("in_place")
        plain.update_weights([(first, before[first])], refresh=False)
        assert torch.equal(runner._params[first].detach(), before[first])  # paused: loaded at once
        plain.update_weights([(last, before[last])], weight_version=version)
        plain.resume()
        out = fut.result(timeout=60)[0]
    assert len(out.output_ids) == 40
    assert out.weight_versions == [version, f"{version}-b", version]
    for n in (first, last):
        assert torch.equal(runner._params[n].detach(), before[n])
