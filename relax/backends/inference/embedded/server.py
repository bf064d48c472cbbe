"""The embedded engine's HTTP server: the SGLang-native subset RL needs (see `protocol.py`), on FastAPI.

`EngineServer` runs uvicorn in a background thread (it works inside a Ray actor: no signal handlers
off the main thread) and returns the bound port, so `port=0` picks a free one.

Bad requests are answered 400 with `{"error": {"message": ...}}` naming the problem (SGLang's shape).
Calls that wait for the engine thread (pause, weight loads, ...) run in worker threads, so the server
keeps answering `/generate`, `/health` and `/metrics` meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.metrics import render_metrics
from relax.backends.inference.embedded.sequence import GenerationResult
from relax.data.mm_codec import decode_inputs
from relax.engine_api.protocol import (
    AbortRequest,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    PauseRequest,
    SamplingParams,
    SlowDownRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromIpcRequest,
)
from relax.utils.net import tcp_listener
from relax.weights.ipc import device_uuid

logger = logging.getLogger(__name__)


def bad_request(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _validation_message(errors: list[dict[str, Any]]) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts)


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


def _item(r: GenerationResult, return_logprob: bool, engine: EmbeddedEngine, text_in_lp: bool) -> dict:
    meta: dict[str, Any] = {
        "id": r.rid,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": len(r.output_ids),
        "cached_tokens": 0,
        "weight_version": r.weight_version,
        "e2e_latency": r.e2e_latency,
    }
    if len(r.weight_versions) > 1:  # Relax's extension: the weights changed while the sample ran
        meta["weight_versions"] = r.weight_versions
        meta["weight_version_starts"] = r.weight_version_starts
    if return_logprob:
        tok = engine.tokenizer if text_in_lp else None
        meta["output_token_logprobs"] = [
            [lp, t, tok.decode([t]) if tok is not None else None]
            for lp, t in zip(r.output_logprobs, r.output_ids, strict=True)
        ]
    return {"text": r.text, "output_ids": r.output_ids, "meta_info": meta}


def _prompts(req: GenerateRequest, engine: EmbeddedEngine) -> list[list[int]]:
    if req.text is not None:
        if engine.tokenizer is None:
            raise ValueError("text input needs a tokenizer and this model folder has none; send input_ids")
        texts = req.text if isinstance(req.text, list) else [req.text]
        prompts = [engine.tokenizer.encode(t) for t in texts]
    else:
        prompts = req.input_ids if req.is_batch else [req.input_ids]
    if not prompts:
        raise ValueError("empty input: no prompt given")
    return prompts


async def _results_unless_disconnected(
    futures: list, request: Request, engine: EmbeddedEngine, rids: list[str]
) -> list[list[GenerationResult]]:
    """Wait for the results; if the caller hangs up first, abort its requests (like SGLang)."""
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


def build_app(engine: EmbeddedEngine) -> FastAPI:
    app = FastAPI(title="relax embedded engine")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return bad_request(f"invalid request: {_validation_message(exc.errors())}")

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Any:
        try:
            prompts = _prompts(req, engine)
            n = len(prompts)
            params = [
                SamplingParams(**(p or {})) for p in _per_prompt(req.sampling_params, n, "sampling_params")
            ]
            logprob = [bool(x) for x in _per_prompt(req.return_logprob, n, "return_logprob")]
            if isinstance(req.rid, list):
                rids = [str(r) for r in _per_prompt(req.rid, n, "rid")]
            else:
                base = req.rid or uuid.uuid4().hex
                rids = [base] if n == 1 else [f"{base}-{i}" for i in range(n)]
            media = [
                decode_inputs(m) if m else None
                for m in _per_prompt(req.multimodal_inputs, n, "multimodal_inputs")
            ]
            for p, sp, mm in zip(prompts, params, media, strict=True):
                engine.validate(p, sp, mm)  # all of them before any is queued
            futures = [
                engine.submit(p, sp, rid=rid, return_logprob=lp, multimodal_inputs=mm)
                for p, sp, rid, lp, mm in zip(prompts, params, rids, logprob, media, strict=True)
            ]
        except ValidationError as e:
            return bad_request(f"invalid sampling_params: {_validation_message(e.errors())}")
        except ValueError as e:
            return bad_request(str(e))
        except RuntimeError as e:  # the engine is shut down
            return bad_request(str(e), status=503)
        try:
            groups = await _results_unless_disconnected(futures, request, engine, rids)
        except RuntimeError as e:
            return bad_request(str(e), status=500)
        items = [
            _item(r, lp, engine, req.return_text_in_logprobs)
            for results, lp in zip(groups, logprob, strict=True)
            for r in results
        ]
        return items if req.is_batch or len(items) > 1 else items[0]

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive() else 503)

    @app.get("/health_generate")
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

    @app.get("/get_model_info")
    async def model_info() -> dict:
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

    @app.get("/get_weight_version")
    async def weight_version() -> dict:
        return {"weight_version": engine.weight_version}

    @app.post("/pause_generation")
    async def pause(request: Request) -> Any:
        body = await request.body()
        try:
            mode = PauseRequest.model_validate_json(body).mode if body.strip() else PauseRequest().mode
        except ValidationError as e:
            return bad_request(f"invalid request: {_validation_message(e.errors())}")
        await asyncio.to_thread(engine.pause, mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume() -> dict:
        await asyncio.to_thread(engine.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = engine.flush_cache()
        return PlainTextResponse("Cache flushed.\n", status_code=200 if ok else 400)

    @app.post("/abort_request")
    async def abort(req: AbortRequest) -> Response:
        await asyncio.to_thread(engine.abort, req.rid or None, req.abort_all)
        return Response(status_code=200)

    @app.post("/slow_down")
    async def slow_down(req: SlowDownRequest) -> dict:
        engine.step_sleep_s = req.forward_sleep_time or 0.0
        return {}

    @app.post("/init_weights_update_group")
    async def init_group(req: InitWeightsUpdateGroupRequest) -> JSONResponse:
        args = (
            req.master_address,
            req.master_port,
            req.rank_offset,
            req.world_size,
            req.group_name,
            req.backend,
        )
        return await _weights_call(
            engine.init_weights_update_group, *args, done="joined the weight update group"
        )

    @app.post("/destroy_weights_update_group")
    async def destroy_group(req: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        return await _weights_call(
            engine.destroy_weights_update_group, req.group_name, done="group destroyed"
        )

    @app.post("/update_weights_from_distributed")
    async def update_distributed(req: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        if req.abort_all_requests:
            await asyncio.to_thread(engine.abort, None, True)
        args = (req.names, req.dtypes, req.shapes, req.group_name, req.weight_version, req.load_format)
        return await _weights_call(
            engine.update_weights_from_distributed, *args, req.flush_cache, done="weights updated"
        )

    @app.post("/update_weights_from_ipc")
    async def update_ipc(req: UpdateWeightsFromIpcRequest) -> JSONResponse:
        args = (req.names, req.dtypes, req.shapes, req.handle, req.weight_version, req.flush_cache)
        return await _weights_call(engine.update_weights_from_ipc, *args, done="weights updated")

    @app.post("/update_weights_from_disk")
    async def update_disk(req: UpdateWeightsFromDiskRequest) -> JSONResponse:
        if req.abort_all_requests:
            await asyncio.to_thread(engine.abort, None, True)
        args = (req.model_path, req.weight_version)
        return await _weights_call(engine.update_weights_from_disk, *args, done="weights loaded")

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = render_metrics(engine)
        return Response(content=body, media_type=content_type)

    return app


async def _weights_call(fn: Any, *args: Any, done: str) -> JSONResponse:
    """Run a blocking weight call in a worker thread; SGLang's {"success", "message"} answer."""
    try:
        await asyncio.to_thread(fn, *args)
    except (ValueError, KeyError, RuntimeError) as e:
        logger.warning("%s failed: %s", fn.__name__, e)
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        return JSONResponse({"success": False, "message": f"{fn.__name__} failed: {msg}"}, status_code=400)
    return JSONResponse({"success": True, "message": f"Succeeded: {done}."})


class EngineServer:
    """An `EmbeddedEngine` behind its HTTP server on a background thread."""

    def __init__(self, model_path: str, host: str = "127.0.0.1", port: int = 0, **engine_kwargs: Any) -> None:
        self.host, self.port = host, port
        self.engine = EmbeddedEngine(model_path, **engine_kwargs)
        self.app = build_app(self.engine)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> int:
        """Start the engine and the server; returns the bound port once the server accepts requests."""
        self.engine.start()
        sock = tcp_listener(self.host, self.port)
        self.port = sock.getsockname()[1]
        # Keep idle connections open longer than clients pool them (httpx: 5 s), so a client never
        # reuses a connection the server is closing at that moment (a spurious ReadError).
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            loop="asyncio",
            lifespan="off",
            timeout_keep_alive=75,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="relax-engine-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"engine HTTP server on {self.url} did not start; see the log above")
            time.sleep(0.02)
        logger.info("engine serving %s at %s", self.engine.runner.model_path, self.url)
        return self.port

    def stop(self) -> None:
        """End in-flight requests (they answer with finish reason abort), stop the server and the engine."""
        if self.engine.is_alive():
            self.engine.abort(abort_all=True)
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=15)
            self._server = self._thread = None
        self.engine.shutdown()
