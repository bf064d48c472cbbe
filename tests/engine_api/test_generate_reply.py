"""A `/generate` reply is a burst of small lists (a `[logprob, id, null]` triple per token): the engine
writes it (`reply_body`) and the client reads it (`read_outputs`) with the cyclic collector paused, so a
long group's reply does not trigger collections that walk the process's objects (only the few passes
once the collector is back on); the bytes and the outputs are those of the plain path, and bodies
msgspec refuses are still read."""

from __future__ import annotations

import gc
import json
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager

from pydantic_core import to_json

from relax.backends.inference.embedded.http.sglang_format import Job, final_item, reply_body
from relax.backends.inference.embedded.scheduling.sequence import GenerationResult
from relax.engine_api.client import GenerateOutput, Reply, read_outputs
from relax.engine_api.protocol import SamplingParams


def group(n: int = 4, length: int = 3000) -> tuple[list[GenerationResult], Job]:
    rng = random.Random(0)
    job = Job([1, 2, 3], SamplingParams(max_new_tokens=length, n=n), "r", True, -1, 0, None, None)
    results = [
        GenerationResult(
            f"r-{j}",
            ids := [rng.randrange(50_000) for _ in range(length)],
            [-rng.random() * 9 for _ in ids],
            {"type": "length", "length": length},
            3,
            "7",
            f"text {j}",
            0.5,
        )
        for j in range(n)
    ]
    return results, job


@contextmanager
def collections_counted() -> Iterator[list[int]]:
    """Every allocation may trigger a collection (threshold 1); yields the list the collections land in."""
    seen: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    threshold = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(1, 1, 1)
    try:
        yield seen
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(count)


def test_the_engine_writes_a_reply_as_fastapi_did_with_no_collection_inside():
    results, job = group()
    plain = to_json([final_item(r, job, None, False) for r in results])
    with collections_counted() as seen:
        body = reply_body([results], [job], None, False, batched=True)
    assert len(seen) <= 10  # the passes once the collector is back on (plain: one per allocation)
    assert body == plain
    items = json.loads(body)
    assert [len(i["meta_info"]["output_token_logprobs"]) for i in items] == [3000] * 4
    one = reply_body([results[:1]], [job], None, False, batched=False)  # n = 1, no batch: the item itself
    assert json.loads(one)["meta_info"]["id"] == "r-0"
    assert gc.isenabled()


def test_the_client_reads_a_reply_as_the_standard_library_does_with_no_collection_inside():
    results, job = group()
    body = reply_body([results], [job], None, False, batched=True)
    with collections_counted() as seen:
        outs = read_outputs(Reply(200, body, "OK"))
    assert len(seen) <= 10
    assert outs == [GenerateOutput.from_json(d) for d in json.loads(body)]
    assert outs[2].output_ids == results[2].output_ids and outs[2].weight_version == "7"
    assert outs[2].output_log_probs == results[2].output_logprobs  # floats round-trip exactly
    with collections_counted() as seen:  # without the pause: a collection every few allocations
        [GenerateOutput.from_json(d) for d in json.loads(body)]
    assert len(seen) > 1000
    assert gc.isenabled()


def test_a_body_msgspec_refuses_is_read_by_the_standard_library():
    body = b'{"text": "", "output_ids": [5], "meta_info": {"output_token_logprobs": [[NaN, 5, null]]}}'
    out = read_outputs(Reply(200, body, "OK"))
    assert out.output_ids == [5] and math.isnan(out.output_log_probs[0])
    assert Reply(200, b"[1, 2]", "OK").json() == [1, 2]
