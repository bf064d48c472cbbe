"""`POST /generate` (and `PUT`, as SGLang serves it): SGLang's request schema (`relax.engine_api.protocol.
GenerateRequest`), answered whole or streamed as server-sent events.

A client that sends `Accept: application/vnd.relax.generate+msgpack` (Relax's `EngineClient`) gets the
finished reply packed (`relax.engine_api.packed`); any other gets SGLang's JSON.

Streaming (`stream: true`): one event per token (or per `stream_interval` tokens) and sample, each
holding the sample's text, tokens and log-probs so far, cumulatively, as SGLang streams them; the last
event of a sample carries its `finish_reason`; then `data: [DONE]`. A batch or `n > 1` interleaves the
samples' events, each with its `index` (prompt-major). Text is released once stable (`IncrementalText`).

A caller that hangs up, streaming or not, has its requests aborted (like SGLang).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.http.http_errors import bad_request, validation_message
from relax.backends.inference.embedded.http.prompt_text import encode_prompt
from relax.backends.inference.embedded.http.sglang_format import (
    Job,
    Partial,
    final_item,
    partial_item,
    reply_body,
)
from relax.backends.inference.embedded.scheduling.sequence import GenerationResult
from relax.data.mm_codec import decode_inputs
from relax.engine_api.packed import MEDIA_TYPE, accepts_packed
from relax.engine_api.protocol import GenerateRequest, SamplingParams
from relax.engine_api.streaming import DONE, IncrementalText, drain_until, sse

logger = logging.getLogger(__name__)


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _prompts(req: GenerateRequest, engine: EmbeddedEngine) -> list[list[int]]:
    if req.text is not None:
        if engine.tokenizer is None:
            raise ValueError("text input needs a tokenizer and this model folder has none; send input_ids")
        texts = req.text if isinstance(req.text, list) else [req.text]
        names = [f"text[{i}]" for i in range(len(texts))] if isinstance(req.text, list) else ["text"]
        prompts = [
            encode_prompt(engine.tokenizer, t, engine.max_context_len, name)
            for t, name in zip(texts, names, strict=True)
        ]
    else:
        prompts = req.input_ids if req.is_batch else [req.input_ids]
    if not prompts:
        raise ValueError("empty input: no prompt given")
    return prompts


def plan(req: GenerateRequest, engine: EmbeddedEngine) -> list[Job]:
    """Validate every prompt of the request (before any is queued) and compile its grammar; ValueError
    (or pydantic's ValidationError for sampling_params) names the problem."""
    prompts = _prompts(req, engine)
    n = len(prompts)
    params = [SamplingParams(**(p or {})) for p in _per_prompt(req.sampling_params, n, "sampling_params")]
    logprob = [bool(x) for x in _per_prompt(req.return_logprob, n, "return_logprob")]
    starts = _per_prompt(req.logprob_start_len, n, "logprob_start_len")
    tops = [int(x or 0) for x in _per_prompt(req.top_logprobs_num, n, "top_logprobs_num")]
    if isinstance(req.rid, list):
        rids = [str(r) for r in _per_prompt(req.rid, n, "rid")]
    else:
        base = req.rid or uuid.uuid4().hex
        rids = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
    media = [
        decode_inputs(m) if m else None for m in _per_prompt(req.multimodal_inputs, n, "multimodal_inputs")
    ]
    jobs = []
    for p, sp, rid, lp, start, top, mm in zip(
        prompts, params, rids, logprob, starts, tops, media, strict=True
    ):
        engine.validate(p, sp, mm)
        first = len(p) - 1 if start is None or start < 0 else int(start)
        if first >= len(p):
            raise ValueError(f"logprob_start_len={first} must be below the prompt's {len(p)} tokens")
        jobs.append(Job(p, sp, rid, lp, first, top, mm, engine.compile_grammar(sp)))
    return jobs


async def _prompt_logprobs(jobs: list[Job], engine: EmbeddedEngine) -> None:
    for job in jobs:
        if job.return_logprob and job.logprob_start < len(job.prompt) - 1:
            job.prompt_logprobs = await asyncio.to_thread(
                engine.prompt_logprobs, job.prompt, job.logprob_start, job.top_k
            )


async def _wait_unless_disconnected(
    futures: list, request: Request, engine: EmbeddedEngine, rids: list[str]
) -> list[list[GenerationResult]]:
    """Wait for the results; if the caller hangs up first, abort its requests."""
    gathered = asyncio.ensure_future(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))
    while True:
        done, _ = await asyncio.wait({gathered}, timeout=1.0)
        if done:
            return gathered.result()
        if await request.is_disconnected():
            logger.info("client of %s went away; aborting", rids)
            for rid in rids:
                await asyncio.to_thread(engine.abort, rid)
            return await gathered


def generate_router(engine: EmbeddedEngine) -> APIRouter:
    router = APIRouter()

    @router.api_route("/generate", methods=["POST", "PUT"])
    async def generate(req: GenerateRequest, request: Request) -> Any:
        try:
            jobs = await asyncio.to_thread(plan, req, engine)  # a grammar may take a moment to build
            await _prompt_logprobs(jobs, engine)
        except ValidationError as e:
            return bad_request(f"invalid sampling_params: {validation_message(e.errors())}")
        except ValueError as e:
            return bad_request(str(e))
        except RuntimeError as e:  # the engine is shut down
            return bad_request(str(e), status=503)
        batched = req.is_batch or any(j.params.n > 1 for j in jobs)
        if req.stream:
            return StreamingResponse(
                _stream(jobs, engine, req.return_text_in_logprobs, batched), media_type="text/event-stream"
            )
        try:
            futures = [_submit(engine, j) for j in jobs]
            groups = await _wait_unless_disconnected(futures, request, engine, [j.rid for j in jobs])
        except ValueError as e:
            return bad_request(str(e))
        except RuntimeError as e:  # a failed step (500), or an engine thread that is gone (503: go elsewhere)
            return bad_request(str(e), status=500 if engine.is_alive() else 503)
        text_in_lp = req.return_text_in_logprobs
        packed = accepts_packed(request.headers.get("accept")) and not text_in_lp
        body = reply_body(groups, jobs, engine.tokenizer, text_in_lp, batched, packed)
        return Response(body, media_type=MEDIA_TYPE if packed else "application/json")

    return router


def _submit(engine: EmbeddedEngine, job: Job, on_token: Any = None) -> Any:
    return engine.submit(
        job.prompt, job.params, rid=job.rid, return_logprob=job.return_logprob, multimodal_inputs=job.media,
        top_logprobs_num=job.top_k, on_token=on_token, grammar=job.grammar,
    )  # fmt: skip


async def _stream(
    jobs: list[Job], engine: EmbeddedEngine, text_in_lp: bool, batched: bool
) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    keys = [(p, j) for p, job in enumerate(jobs) for j in range(job.params.n)]
    index = {key: i for i, key in enumerate(keys)}
    partials = {key: Partial() for key in keys}
    texts = {
        (p, j): IncrementalText(
            engine.tokenizer, jobs[p].params.skip_special_tokens, jobs[p].params.stop_strings
        )
        for p, j in keys
    }

    def on_token_of(p: int) -> Any:
        return lambda j, t, lp, top: loop.call_soon_threadsafe(queue.put_nowait, (p, j, t, lp, top))

    try:
        futures = [_submit(engine, job, on_token_of(p)) for p, job in enumerate(jobs)]
    except (ValueError, RuntimeError) as e:
        yield sse({"error": {"message": str(e)}})
        yield DONE
        return
    done = asyncio.ensure_future(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def chunk(key: tuple[int, int], item: dict[str, Any]) -> str:
        if batched:
            item["index"] = index[key]
        return sse(item)

    try:
        async for items in drain_until(queue, done):
            touched = []
            for p, j, t, lp, top in items:
                part = partials[(p, j)]
                part.output_ids.append(t)
                part.logprobs.append(lp)
                part.top.append(top)
                touched.append((p, j))
            for key in dict.fromkeys(touched):
                part, job = partials[key], jobs[key[0]]
                if len(part.output_ids) - part.emitted < (job.params.stream_interval or 1):
                    continue
                texts[key].add(part.output_ids[part.emitted :])
                part.emitted = len(part.output_ids)
                rid = job.rid if job.params.n == 1 else f"{job.rid}-{key[1]}"
                item = partial_item(
                    part, job, rid, texts[key].sent, engine.tokenizer, text_in_lp, engine.weight_version
                )
                yield chunk(key, item)
        try:
            groups = done.result()
        except RuntimeError as e:
            yield sse({"error": {"message": str(e)}})
            yield DONE
            return
        for p, results in enumerate(groups):
            for j, r in enumerate(results):
                yield chunk((p, j), final_item(r, jobs[p], engine.tokenizer, text_in_lp))
        yield DONE
    finally:
        if not done.done():  # the client went away mid-stream
            logger.info("streaming client of %s went away; aborting", [j.rid for j in jobs])
            for job in jobs:  # queued, not awaited: this task is being cancelled
                engine.abort_soon(job.rid)
