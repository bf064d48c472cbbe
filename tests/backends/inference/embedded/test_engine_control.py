"""Continuous batching, abort and pause/continue while requests are in flight, on a real server.

`/slow_down` makes every engine step sleep a little so that "in flight" lasts long enough to act on.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import torch

from tests.engine_helpers import run, trainer_logprobs

LONG = {"max_new_tokens": 400, "ignore_eos": True}


@pytest.fixture
def slow(client):
    run(client.slow_down(0.01))
    yield client
    run(client.resume())
    run(client.abort(abort_all=True))
    run(client.slow_down(None))


def generated_tokens(metrics_text: str) -> float:
    return float(re.search(r"^sglang:generation_tokens_total\{[^}]*\} (\S+)$", metrics_text, re.M).group(1))


async def wait_running(client, n: int = 1) -> None:
    for _ in range(500):
        if re.search(rf"^sglang:num_running_reqs\{{[^}}]*\}} {n}\.0$", await client.metrics_text(), re.M):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never saw {n} running requests")


def check_logprobs(model, prompt, out) -> None:
    ref = trainer_logprobs(model, prompt, out.output_ids)
    assert torch.allclose(torch.tensor(out.output_log_probs), ref, atol=1e-4)


def test_a_short_request_finishes_while_a_long_one_runs(slow, reference_model):
    client = slow
    long_prompt, short_prompt = list(range(40, 71)), [9, 8, 7]

    async def go():
        long = asyncio.create_task(client.generate(long_prompt, LONG, rid="long"))
        await wait_running(client, 1)
        short = await client.generate(short_prompt, {"max_new_tokens": 5, "ignore_eos": True})
        assert not long.done(), "the long request should still be running"
        await client.abort("long")
        return short, await long

    short, long = run(go())
    assert len(short.output_ids) == 5 and short.finish_reason == "length"
    assert long.finish_reason == "abort" and 5 < len(long.output_ids) < 400
    check_logprobs(reference_model, short_prompt, short)  # rows of different lengths merged correctly
    check_logprobs(reference_model, long_prompt, long)


def test_abort_one_request_by_rid_and_all(slow):
    client = slow

    async def go():
        tasks = [asyncio.create_task(client.generate([i + 1] * 4, LONG, rid=f"r{i}")) for i in range(3)]
        await wait_running(client, 3)
        await client.abort("r1")
        one = await tasks[1]
        assert not tasks[0].done() and not tasks[2].done()
        await client.abort(abort_all=True)
        return one, await tasks[0], await tasks[2]

    one, a, b = run(go())
    for out in (one, a, b):
        assert out.finish_reason == "abort" and len(out.output_log_probs) == len(out.output_ids) < 400


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_stops_progress_and_continue_finishes(slow, reference_model, mode):
    client = slow
    prompt = [3, 1, 4, 1, 5]
    params = {"max_new_tokens": 60, "ignore_eos": True}

    async def go():
        task = asyncio.create_task(client.generate(prompt, params))
        await wait_running(client, 1)
        await client.pause(mode)
        before = generated_tokens(await client.metrics_text())
        queued = asyncio.create_task(client.generate([2, 7], {"max_new_tokens": 3, "ignore_eos": True}))
        await asyncio.sleep(0.3)
        assert generated_tokens(await client.metrics_text()) == before, "a paused engine generated tokens"
        assert not task.done() and not queued.done()
        await client.health()  # still answering
        await client.resume()
        return await task, await queued

    out, queued = run(go())
    assert out.finish_reason == "length" and len(out.output_ids) == 60
    assert len(queued.output_ids) == 3
    check_logprobs(reference_model, prompt, out)  # retract: the recomputed cache continues exactly


def test_pause_in_abort_mode_ends_requests(slow):
    client = slow

    async def go():
        task = asyncio.create_task(client.generate([1, 2, 3], LONG))
        await wait_running(client, 1)
        await client.pause("abort")
        out = await task
        await client.resume()
        return out

    assert run(go()).finish_reason == "abort"


def test_a_caller_that_hangs_up_gets_its_request_aborted(slow, engine_server):
    body = {"input_ids": [4, 4, 4], "sampling_params": LONG}
    before = generated_tokens(run(slow.metrics_text()))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(engine_server.url + "/generate", json=body, timeout=0.3)
    run(wait_running(slow, 0))
    # ended by the abort, not by running out its 400 tokens (at >= 10 ms a step, that takes > 4 s)
    assert generated_tokens(run(slow.metrics_text())) - before < 400
