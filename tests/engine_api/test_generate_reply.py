"""A `/generate` reply is a burst of small lists (a `[logprob, id, null]` triple per token): the engine
writes it (`reply_body`) and the client reads it (`read_outputs`) with the cyclic collector paused, so a
long group's reply does not trigger collections that walk the process's objects (only the few passes
once the collector is back on); the bytes and the outputs are those of the plain path, and bodies
msgspec refuses are still read. The packed reply (MessagePack, the output ids and log-probs as raw arrays)
reads as the JSON one, value for value."""

from __future__ import annotations

import gc
import json
import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
from pydantic_core import to_json

from relax.backends.inference.embedded.http.sglang_format import Job, final_item, reply_body
from relax.backends.inference.embedded.scheduling.sequence import GenerationResult
from relax.engine_api import packed
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


def without_meta(outs: list[GenerateOutput]) -> list[GenerateOutput]:
    return [replace(o, meta_info={}) for o in outs]


def test_a_packed_reply_reads_as_the_json_one_value_for_value():
    results, job = group()
    results[0].output_logprobs[:3] = [float("-inf"), -0.0, 1e-300]  # values JSON writes and reads exactly
    js = reply_body([results], [job], None, False, batched=True)
    body = reply_body([results], [job], None, False, batched=True, packed=True)
    assert len(body) < len(js) / 2
    with collections_counted() as seen:
        outs = read_outputs(Reply(200, body, "OK", packed.MEDIA_TYPE))
    assert len(seen) <= 10
    plain = read_outputs(Reply(200, js, "OK"))
    assert without_meta(outs) == without_meta(plain)
    assert outs[0].output_log_probs[:3] == [float("-inf"), -0.0, 1e-300]
    assert [o.output_log_probs for o in outs] == [r.output_logprobs for r in results]
    assert [o.output_ids for o in outs] == [r.output_ids for r in results]
    # meta_info keeps JSON's fields but the output triples, which the packed values replace
    meta = {k: v for k, v in json.loads(js)[1]["meta_info"].items() if k != "output_token_logprobs"}
    assert outs[1].meta_info == meta
    one = read_outputs(
        Reply(200, reply_body([results[:1]], [job], None, False, False, True), "", packed.MEDIA_TYPE)
    )
    assert one.rid == "r-0" and one.output_ids == results[0].output_ids


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return f"<{ids[0]}>"


def test_log_probs_with_token_text_and_replies_without_log_probs():
    results, job = group(n=2, length=5)
    body = reply_body([results], [job], _Tokenizer(), True, batched=True, packed=True)
    items = json.loads(body)  # the triples carry text: JSON, whatever the client accepts
    assert items[0]["meta_info"]["output_token_logprobs"][0][2] == f"<{results[0].output_ids[0]}>"
    job.return_logprob = False
    out = read_outputs(
        Reply(200, reply_body([results], [job], None, False, True, True), "", packed.MEDIA_TYPE)
    )
    assert out[1].output_ids == results[1].output_ids and out[1].output_log_probs == []


@pytest.mark.parametrize(
    ("accept", "packs"),
    [
        (packed.ACCEPT, True),
        (packed.MEDIA_TYPE, True),
        ("application/json, application/vnd.relax.generate+msgpack;q=0.1", True),
        ("application/json", False),
        ("*/*", False),
        ("application/vnd.relax.generate+json", False),
        ("", False),
        (None, False),
    ],
)
def test_only_an_accept_header_that_names_the_packed_type_gets_it(accept, packs):
    assert packed.accepts_packed(accept) is packs
