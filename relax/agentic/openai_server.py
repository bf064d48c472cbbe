"""An OpenAI-compatible `/v1/chat/completions` endpoint over the rollout's inference engines, so an agent
program written against any OpenAI client can be trained.

One server per Rollout role, on 127.0.0.1, running on the role's event loop (its calls go through the
same router and weight-update gate as every other generation request). Each sample's agent gets its own
session, addressed by the base URL `http://127.0.0.1:PORT/s/<session_id>/v1` (or by the header
`X-Relax-Session` on `/v1/...`). Supported: `messages`, `tools`, `max_tokens` /
`max_completion_tokens`, `temperature`, `top_p`, `stream` (server-sent events); `n` must be 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from relax.agentic.session import ChatSession

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without signal handlers: it runs inside a role whose process owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _error(message: str, status: int, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


class OpenAIServer:
    def __init__(self, model_name: str = "relax-policy") -> None:
        self.model_name = model_name
        self.sessions: dict[str, ChatSession] = {}
        self.app = self._build_app()
        self._server: _Server | None = None
        self._task: Any = None
        self._starting: Any = None  # asyncio.Lock, made on the loop that starts the server
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def base_url(self, session_id: str) -> str:
        """What an OpenAI client takes as `base_url` for this session."""
        return f"{self.url}/s/{session_id}/v1"

    def open_session(self, session: ChatSession) -> None:
        self.sessions[session.session_id] = session

    def close_session(self, session_id: str) -> ChatSession | None:
        return self.sessions.pop(session_id, None)

    async def start(self, timeout_s: float = 30.0) -> str:
        """Serve on a free port of 127.0.0.1 on the running event loop; returns the URL."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:  # concurrent first callers start one server
            if self._server is None:
                await self._serve(timeout_s)
        return self.url

    async def _serve(self, timeout_s: float) -> None:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", access_log=False)
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve())
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                raise RuntimeError(f"the OpenAI endpoint did not start: {self._task.exception()!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI endpoint did not start within {timeout_s}s")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        logger.info("OpenAI-compatible endpoint on %s", self.url)

    def should_stop(self) -> None:
        """Ask the server to stop (it ends with its event loop's next iterations)."""
        if self._server is not None:
            self._server.should_exit = True

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
            self._server = None

    # -- HTTP --------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title="Relax OpenAI-compatible endpoint")

        @app.get("/s/{session_id}/v1/models")
        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "owned_by": "relax"}],
            }

        @app.post("/s/{session_id}/v1/chat/completions")
        async def session_chat(session_id: str, request: Request) -> Any:
            return await self._chat(session_id, request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            return await self._chat(request.headers.get("x-relax-session", ""), request)

        return app

    async def _chat(self, session_id: str, request: Request) -> Any:
        session = self.sessions.get(session_id)
        if session is None:
            return _error(
                f"unknown session {session_id!r}: use the base URL Relax gave the agent "
                "(RELAX_BASE_URL, http://127.0.0.1:PORT/s/<session>/v1)",
                404,
            )
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error("the request body is not JSON", 400)
        if int(body.get("n") or 1) != 1:
            return _error("n must be 1 (each call is one step of the trajectory)", 400)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error("messages must be a non-empty list", 400)
        try:
            reply, finish, usage = await session.chat(
                messages,
                body.get("tools") or None,
                max_tokens=body.get("max_completion_tokens") or body.get("max_tokens"),
                temperature=body.get("temperature"),
                top_p=body.get("top_p"),
            )
        except ValueError as e:
            return _error(str(e), 400)
        cid = f"chatcmpl-{uuid.uuid4().hex[:16]}"
        created = int(time.time())
        if body.get("stream"):
            return StreamingResponse(
                self._stream(cid, created, reply, finish, usage), media_type="text/event-stream"
            )
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": body.get("model") or self.model_name,
            "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
            "usage": usage,
        }

    def _stream(self, cid: str, created: int, reply: dict, finish: str, usage: dict) -> Iterator[str]:
        def chunk(delta: dict[str, Any], reason: str | None = None) -> str:
            data = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": reason}],
            }
            return f"data: {json.dumps(data)}\n\n"

        yield chunk({"role": "assistant", "content": ""})
        if reply.get("content"):
            yield chunk({"content": reply["content"]})
        for k, call in enumerate(reply.get("tool_calls") or []):
            yield chunk({"tool_calls": [{"index": k, **call}]})
        yield chunk({}, finish)
        yield "data: [DONE]\n\n"
