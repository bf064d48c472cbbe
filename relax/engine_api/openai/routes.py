"""The OpenAI-compatible routes, for any `OpenAIBackend`: `GET /models`, `GET /models/{id}`,
`POST /chat/completions`, `POST /completions` (mounted under `/v1`, or a session's `/s/<id>/v1`).

`openai_router(resolve)`: `resolve(request)` gives the backend of a request (the engine; a session by its
id) or raises `OpenAIError` (404 for an unknown session). Errors are answered in OpenAI's shape.
Streaming sends each choice's tokens as the engine samples them, then the finish reasons, then (with
`stream_options.include_usage`) a usage chunk, then `[DONE]`; a client that hangs up cancels the
generation (the backend aborts it).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from relax.engine_api.openai.backend import ChatPrompt, Choice, OpenAIBackend
from relax.engine_api.openai.convert import apply_response_format, apply_tools, sampling_params
from relax.engine_api.openai.echo import PromptScores, echoed_choice, score_prompt
from relax.engine_api.openai.errors import OpenAIError, openai_error
from relax.engine_api.openai.messages import template_options
from relax.engine_api.openai.replies import (
    assistant_message,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    reasoning_of,
    usage,
)
from relax.engine_api.openai.schema import ChatCompletionRequest, CompletionRequest
from relax.engine_api.openai.streaming import ChoiceStream
from relax.engine_api.streaming import DONE, drain_until, sse

Resolve = Callable[[Request], "OpenAIBackend | Awaitable[OpenAIBackend]"]


async def _backend(resolve: Resolve, request: Request) -> OpenAIBackend:
    backend = resolve(request)
    return await backend if inspect.isawaitable(backend) else backend


async def _body(request: Request, model: type[BaseModel]) -> Any:
    try:
        data = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as e:
        raise OpenAIError(f"the request body is not JSON ({e.msg})", 400) from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ())) or None
        msg = "; ".join(
            (".".join(str(x) for x in err.get("loc", ())) + ": " if err.get("loc") else "")
            + str(err.get("msg")).removeprefix("Value error, ")
            for err in e.errors()
        )
        raise OpenAIError(msg, 400, param) from e


def _check_n(backend: OpenAIBackend, n: int) -> None:
    if backend.max_n is not None and n > backend.max_n:
        raise OpenAIError(f"n must be at most {backend.max_n} here: {backend.n_refusal}", 400, "n")


def _check_model(backend: OpenAIBackend, name: str | None) -> None:
    """A request naming a model this server does not serve is refused, as vLLM and OpenAI refuse it (404,
    `model_not_found`): the name listed by /v1/models is served, and the backend's `model_aliases` (the
    model path the server was given). A backend without `strict_model_names` (an agent's session, which
    serves its one policy under whatever name the agent's code uses) accepts any name."""
    if not name or not getattr(backend, "strict_model_names", False):
        return
    if name != backend.model_name and name not in getattr(backend, "model_aliases", ()):
        raise OpenAIError(
            f"The model `{name}` does not exist; this server serves `{backend.model_name}`",
            404,
            "model",
            "model_not_found",
        )


def _card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "relax"}


def openai_router(resolve: Resolve) -> APIRouter:
    router = APIRouter()

    def guarded(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except OpenAIError as e:
                return openai_error(e.message, e.status, e.param, e.code)

        run.__signature__ = inspect.signature(fn)  # FastAPI reads the parameters
        run.__name__ = fn.__name__
        return run

    @router.get("/models")
    @guarded
    async def models(request: Request) -> Any:
        backend = await _backend(resolve, request)
        return {"object": "list", "data": [_card(backend.model_name)]}

    @router.get("/models/{model_id:path}")
    @guarded
    async def model(model_id: str, request: Request) -> Any:
        backend = await _backend(resolve, request)
        if model_id != backend.model_name:
            raise OpenAIError(
                f"model {model_id!r} does not exist; this server serves {backend.model_name!r}",
                404,
                "model",
                "model_not_found",
            )
        return _card(backend.model_name)

    @router.post("/chat/completions")
    @guarded
    async def chat(request: Request) -> Any:
        backend = await _backend(resolve, request)
        req: ChatCompletionRequest = await _body(request, ChatCompletionRequest)
        _check_model(backend, req.model)
        _check_n(backend, req.n)
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
        params = sampling_params(req, req.max_new_tokens)
        apply_response_format(params, req.response_format)
        parse_tools = apply_tools(params, req, backend.tokenizer)
        prompt = await backend.chat_prompt(req.messages, req.tools, template_options(req))
        top_n = (req.top_logprobs or 0) if req.logprobs else 0
        reasoning = reasoning_of(backend, req.separate_reasoning)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": req.model or backend.model_name}  # fmt: skip
        if req.stream:
            gen = _chat_stream(backend, prompt, params, req, parse_tools, top_n, head)
            return StreamingResponse(gen, media_type="text/event-stream")
        choices = await backend.generate(prompt.prompt_ids, params, top_logprobs=top_n)
        out, replies = [], []
        for j, c in enumerate(choices):
            message, calls = assistant_message(c.text, parse_tools, backend, prompt, reasoning)
            replies.append(message)
            logprobs = (
                chat_logprobs(c.output_ids, c.logprobs, c.top_logprobs, backend.tokenizer, top_n)
                if req.logprobs
                else None
            )
            out.append(
                {
                    "index": j,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason(c, calls),
                }
            )
        await backend.record(prompt, choices, replies)
        return {
            **head,
            "object": "chat.completion",
            "choices": out,
            "usage": usage(len(prompt.prompt_ids), choices),
        }

    @router.post("/completions")
    @guarded
    async def completions(request: Request) -> Any:
        backend = await _backend(resolve, request)
        req: CompletionRequest = await _body(request, CompletionRequest)
        _check_model(backend, req.model)
        _check_n(backend, req.n)
        prompts = [backend.text_prompt(p) for p in req.prompts]
        params = sampling_params(req, req.max_tokens)
        top_n = req.logprobs or 0
        head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": req.model or backend.model_name}  # fmt: skip
        if req.stream:
            if req.echo:
                raise OpenAIError("echo is not served with stream", 400, "echo")
            return StreamingResponse(
                _completion_stream(backend, prompts, params, req, top_n, head), media_type="text/event-stream"
            )

        async def one(ids: list[int]) -> tuple[list[Choice], PromptScores | None]:
            choices = await backend.generate(ids, params, top_logprobs=top_n)
            scored = req.echo and req.logprobs is not None
            return choices, (await score_prompt(backend, ids, top_n) if scored else None)

        groups = await asyncio.gather(*(one(p) for p in prompts))
        out = []
        for p, (ids, (choices, scores)) in enumerate(zip(prompts, groups, strict=True)):
            for j, c in enumerate(choices):
                text, lp = c.text, None
                if req.echo:
                    given = req.prompts[p]
                    tok = backend.tokenizer
                    said = given if isinstance(given, str) else tok.decode(ids) if tok is not None else ""
                    text, lp = echoed_choice(ids, said, scores, c, backend.tokenizer)
                elif req.logprobs is not None:
                    lp = completion_logprobs(c.output_ids, c.logprobs, c.top_logprobs, backend.tokenizer)
                out.append(
                    {
                        "index": p * req.n + j,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": finish_reason(c, []),
                    }
                )
            await backend.record(
                ChatPrompt(ids), choices, [{"role": "assistant", "content": c.text} for c in choices]
            )
        all_choices = [c for g, _ in groups for c in g]
        body = {
            **head,
            "object": "text_completion",
            "choices": out,
            "usage": usage(sum(map(len, prompts)), all_choices),
        }
        return JSONResponse(body)

    return router


async def _generation_events(
    backend: OpenAIBackend, prompt_ids: list[int], params: dict[str, Any], top_n: int
) -> AsyncIterator[tuple[str, Any]]:
    """("tokens", (choice, ids, lps, tops)) as the engine samples them, then ("done", choices); the
    generation is cancelled when the consumer stops early."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_tokens(j: int, ids: list[int], lps: list[float], tops: list[Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (j, ids, lps, tops))

    task = asyncio.ensure_future(
        backend.generate(prompt_ids, params, top_logprobs=top_n, on_tokens=on_tokens)
    )
    try:
        async for items in drain_until(queue, task):
            for item in items:
                yield "tokens", item
        yield "done", task.result()
    finally:
        if not task.done():
            task.cancel()


async def _chat_stream(
    backend: OpenAIBackend, prompt: ChatPrompt, params: dict[str, Any], req: ChatCompletionRequest,
    parse_tools: bool, top_n: int, head: dict[str, Any],
) -> AsyncIterator[str]:  # fmt: skip
    extra = {"usage": None} if req.include_usage else {}

    def chunk(j: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        choice = {"index": j, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**head, "object": "chat.completion.chunk", "choices": [choice], **extra})

    skip = params.get("skip_special_tokens", True)
    reasoning = reasoning_of(backend, req.separate_reasoning)
    streams = [
        ChoiceStream(backend.tokenizer, skip, _stops(params), parse_tools, reasoning) for _ in range(req.n)
    ]
    for j in range(req.n):
        yield chunk(j, {"role": "assistant", "content": ""})
    try:
        async for kind, value in _generation_events(backend, prompt.prompt_ids, params, top_n):
            if kind == "tokens":
                j, ids, lps, tops = value
                delta = streams[j].add_chat(ids, lps, tops)
                lp = chat_logprobs(ids, lps, tops, backend.tokenizer, top_n) if req.logprobs else None
                if delta or lp:
                    yield chunk(j, delta or {"content": ""}, logprobs=lp)
                continue
            choices: list[Choice] = value
    except OpenAIError as e:
        yield sse(
            {
                "error": {
                    "message": e.message,
                    "type": "invalid_request_error",
                    "param": e.param,
                    "code": e.status,
                }
            }
        )
        yield DONE
        return
    replies = []
    for j, c in enumerate(choices):
        message, calls = assistant_message(c.text, parse_tools, backend, prompt, reasoning)
        replies.append(message)
        rest = streams[j].finish_chat(message)
        if rest:
            yield chunk(j, rest)
        if calls:
            yield chunk(j, {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]})
        yield chunk(j, {}, finish_reason(c, calls))
    await backend.record(prompt, choices, replies)
    if req.include_usage:
        yield sse(
            {
                **head,
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": usage(len(prompt.prompt_ids), choices),
            }
        )
    yield DONE


async def _completion_stream(
    backend: OpenAIBackend, prompts: list[list[int]], params: dict[str, Any], req: CompletionRequest,
    top_n: int, head: dict[str, Any],
) -> AsyncIterator[str]:  # fmt: skip
    extra = {"usage": None} if req.include_usage else {}
    skip = params.get("skip_special_tokens", True)
    all_choices: list[Choice] = []
    for p, ids in enumerate(prompts):
        streams = [ChoiceStream(backend.tokenizer, skip, _stops(params), False) for _ in range(req.n)]

        def chunk(j: int, text: str, finish: str | None = None, logprobs: Any = None, p: int = p) -> str:
            choice = {"index": p * req.n + j, "text": text, "logprobs": logprobs, "finish_reason": finish}
            return sse({**head, "object": "text_completion", "choices": [choice], **extra})

        try:
            async for kind, value in _generation_events(backend, ids, params, top_n):
                if kind == "tokens":
                    j, new, lps, tops = value
                    delta = streams[j].add(new, lps, tops)
                    lp = (
                        completion_logprobs(new, lps, tops, backend.tokenizer)
                        if req.logprobs is not None
                        else None
                    )
                    if delta or lp:
                        yield chunk(j, delta, logprobs=lp)
                    continue
                choices: list[Choice] = value
        except OpenAIError as e:
            yield sse(
                {
                    "error": {
                        "message": e.message,
                        "type": "invalid_request_error",
                        "param": e.param,
                        "code": e.status,
                    }
                }
            )
            yield DONE
            return
        for j, c in enumerate(choices):
            yield chunk(j, streams[j].finish(c.text), finish_reason(c, []))
        await backend.record(
            ChatPrompt(ids), choices, [{"role": "assistant", "content": c.text} for c in choices]
        )
        all_choices += choices
    if req.include_usage:
        yield sse(
            {
                **head,
                "object": "text_completion",
                "choices": [],
                "usage": usage(sum(map(len, prompts)), all_choices),
            }
        )
    yield DONE


def _stops(params: dict[str, Any]) -> list[str]:
    stop = params.get("stop")
    return [stop] if isinstance(stop, str) else [s for s in stop or [] if s]
