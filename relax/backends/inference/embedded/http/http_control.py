"""The engine's control routes (SGLang's): pause and continue generation, flush, abort, slow down, and
the weight updates (a process group, CUDA IPC, disk). Calls that wait for the engine thread run in
worker threads, so the server keeps answering `/generate`, `/health` and `/metrics` meanwhile."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.http.http_errors import bad_request, validation_message
from relax.engine_api.protocol import (
    AbortRequest,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PauseRequest,
    SlowDownRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromIpcRequest,
)
from relax.utils.tasks import in_daemon_thread

logger = logging.getLogger(__name__)


def control_router(engine: EmbeddedEngine) -> APIRouter:
    router = APIRouter()
    joining = asyncio.Lock()

    @router.post("/pause_generation")
    async def pause(request: Request) -> Any:
        body = await request.body()
        try:
            mode = PauseRequest.model_validate_json(body).mode if body.strip() else PauseRequest().mode
        except ValidationError as e:
            return bad_request(f"invalid request: {validation_message(e.errors())}")
        await asyncio.to_thread(engine.pause, mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @router.post("/continue_generation")
    async def resume() -> dict:
        await asyncio.to_thread(engine.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = engine.flush_cache()
        return PlainTextResponse("Cache flushed.\n", status_code=200 if ok else 400)

    @router.post("/abort_request")
    async def abort(req: AbortRequest) -> Response:
        await asyncio.to_thread(engine.abort, req.rid or None, req.abort_all)
        return Response(status_code=200)

    @router.post("/slow_down")
    async def slow_down(req: SlowDownRequest) -> dict:
        engine.step_sleep_s = req.forward_sleep_time or 0.0
        return {}

    @router.post("/init_weights_update_group")
    async def init_group(req: InitWeightsUpdateGroupRequest) -> JSONResponse:
        if joining.locked():  # one rendezvous at a time; a second would only queue behind a stuck one
            return JSONResponse(
                {"success": False, "message": "a weight-update group join is already in progress"}, 409
            )
        async with joining:
            return await _weights_call(
                engine.init_weights_update_group, req, done="joined the weight update group"
            )

    @router.post("/destroy_weights_update_group")
    async def destroy_group(req: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        return await _weights_call(
            engine.destroy_weights_update_group, req.group_name, done="group destroyed"
        )

    @router.post("/update_weights_from_distributed")
    async def update_distributed(req: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        if req.abort_all_requests:
            await asyncio.to_thread(engine.abort, None, True)
        return await _weights_call(engine.update_weights_from_distributed, req, done="weights updated")

    @router.post("/update_weights_from_ipc")
    async def update_ipc(req: UpdateWeightsFromIpcRequest) -> JSONResponse:
        return await _weights_call(engine.update_weights_from_ipc, req, done="weights updated")

    @router.post("/update_weights_from_disk")
    async def update_disk(req: UpdateWeightsFromDiskRequest) -> JSONResponse:
        if req.abort_all_requests:
            await asyncio.to_thread(engine.abort, None, True)
        args = (req.model_path, req.weight_version)
        return await _weights_call(engine.update_weights_from_disk, *args, done="weights loaded")

    return router


async def _weights_call(fn: Any, *args: Any, done: str) -> JSONResponse:
    """Run a blocking weight call on a daemon thread; SGLang's {"success", "message"} answer."""
    try:
        await in_daemon_thread(fn, *args)
    except (ValueError, KeyError, RuntimeError) as e:
        logger.warning("%s failed: %s", fn.__name__, e)
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        return JSONResponse({"success": False, "message": f"{fn.__name__} failed: {msg}"}, status_code=400)
    return JSONResponse({"success": True, "message": f"Succeeded: {done}."})
