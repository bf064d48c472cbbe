"""The engine's read-only native routes: health, model and server info, weight version, tokenize /
detokenize (SGLang's shapes) and Prometheus metrics. `/health` is its own router: the one route that
stays open when the routes require a token (`server.build_app`'s `dependencies`)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, field_validator

import relax
from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.http.http_errors import bad_request
from relax.backends.inference.embedded.http.metrics import render_metrics
from relax.backends.inference.embedded.http.prompt_text import encode_prompt
from relax.engine_api.protocol import SamplingParams, check_unicode
from relax.weights.ipc import device_uuid


class TokenizeRequest(BaseModel):
    """SGLang's `/tokenize` body (`model` is accepted and not checked: one model per engine)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str | list[str]
    add_special_tokens: bool = True
    model: str | None = None

    @field_validator("prompt")
    @classmethod
    def _unicode(cls, v: str | list[str]) -> str | list[str]:
        return check_unicode(v, "prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True
    model: str | None = None


def health_router(engine: EmbeddedEngine) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive() else 503)

    return router


def info_router(engine: EmbeddedEngine) -> APIRouter:
    router = APIRouter()

    @router.get("/health_generate")
    async def health_generate() -> Response:
        if not engine.is_alive():
            return Response(status_code=503)
        if engine.paused:  # a paused engine is healthy but will not generate
            return Response(status_code=200)
        fut = engine.submit(
            [0], SamplingParams(max_new_tokens=1, temperature=0.0), rid=f"health-{uuid.uuid4().hex}"
        )
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), timeout=60)
        except TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

    @router.get("/get_model_info")
    async def model_info() -> dict:
        return _model_info(engine)

    @router.get("/get_server_info")
    @router.get("/server_info")
    @router.get("/get_server_args")
    async def server_info() -> dict:
        """SGLang's server info: the server's arguments, its state, the version (Relax's)."""
        m = engine.metrics()
        return {
            **_model_info(engine),
            "version": relax.__version__,
            "context_length": engine.max_context_len,
            "max_running_requests": engine.scheduler.max_running,
            "max_total_num_tokens": engine.scheduler.max_total_tokens,
            "max_prefill_tokens": engine.scheduler.max_prefill_tokens,
            "skip_tokenizer_init": engine.tokenizer is None,
            "grammar_backend": "llguidance",
            "internal_states": [
                {"last_gen_throughput": m.gen_throughput, "num_running_reqs": m.num_running,
                 "num_queue_reqs": m.num_waiting, "paused": m.paused}
            ],
        }  # fmt: skip

    @router.get("/get_weight_version")
    async def weight_version() -> dict:
        return {"weight_version": engine.weight_version}

    @router.post("/tokenize")
    @router.post("/v1/tokenize")
    async def tokenize(req: TokenizeRequest) -> Any:
        tok = engine.tokenizer
        if tok is None:
            return bad_request("this model folder has no tokenizer")
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt

        def encode() -> list[list[int]]:
            return [
                encode_prompt(
                    tok, t, engine.max_context_len, "prompt", add_special_tokens=req.add_special_tokens
                )
                for t in texts
            ]

        try:  # off the event loop: a long text must not hold up every other route
            ids = await asyncio.to_thread(encode)
        except ValueError as e:
            return bad_request(str(e))
        if isinstance(req.prompt, str):
            return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": engine.max_context_len}
        return {"tokens": ids, "count": [len(i) for i in ids], "max_model_len": engine.max_context_len}

    @router.post("/detokenize")
    @router.post("/v1/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Any:
        tok = engine.tokenizer
        if tok is None:
            return bad_request("this model folder has no tokenizer")
        batch = bool(req.tokens) and isinstance(req.tokens[0], list)
        seqs = req.tokens if batch else [req.tokens]
        bad = [t for s in seqs for t in s if not 0 <= t < engine.runner.vocab_size]
        if bad:
            return bad_request(
                f"tokens holds ids outside the vocabulary [0, {engine.runner.vocab_size}): {bad[:5]}"
            )
        texts = [tok.decode(s, skip_special_tokens=req.skip_special_tokens) for s in seqs]
        return {"text": texts if batch else texts[0]}

    @router.get("/metrics")
    async def metrics() -> Response:
        body, content_type = render_metrics(engine)
        return Response(content=body, media_type=content_type)

    return router


def _model_info(engine: EmbeddedEngine) -> dict[str, Any]:
    r = engine.runner
    return {
        "model_path": r.model_path,
        "tokenizer_path": r.model_path if r.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "max_context_len": engine.max_context_len,
        "device": str(r.device),
        "device_uuid": device_uuid(r.device),
        "dtype": str(r.dtype).removeprefix("torch."),
        "engine": "relax-embedded",
        # a push may arrive while it generates: loaded between two steps, all buckets at once
        "live_weight_updates": True,
    }
