"""The agent endpoint: the OpenAI-compatible API (`relax.engine_api.openai`, the same routes every
embedded engine serves) over the sessions of external agents, so an agent program written against any
OpenAI client can be trained.

One server per Rollout role (or per `relax agent serve`), running on its event loop (calls go through the
same router and weight-update gate as every other generation request). Each sample's agent gets its own
session (`ChatSession`), addressed by the base URL `http://HOST:PORT/s/<session_id>/v1` or by the header
`X-Relax-Session` on `/v1/...`. With `new_session` given, an unknown session id opens a session (the
standalone development mode); otherwise it is a 404. `dependencies` (FastAPI `Depends(...)`) guard every
route.

Authentication (relax/utils/auth.py): every route asks for a bearer token, the run's (`api_key`, by
default the process's run token) or the token of the session the request addresses (`issue_token`):
an external agent is given only its own session's token, so it can neither reach another session nor
any other server of the run. With neither an `api_key` nor issued tokens, nothing is checked (a local
`relax agent serve` without `--api-key`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from relax.agentic.session import ChatSession
from relax.engine_api.openai.backend import ChatPrompt
from relax.engine_api.openai.errors import OpenAIError, openai_error
from relax.engine_api.openai.routes import openai_router
from relax.utils.auth import guard, process_token
from relax.utils.http_deadline import header_deadline_protocol
from relax.utils.http_limits import limit_requests
from relax.utils.redact import register_secret

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-relax-session"


class _Server(uvicorn.Server):
    """uvicorn without signal handlers: it runs inside a process that owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _NoSession:
    """The backend of a request that names no session: it lists the model and generates nothing."""

    max_n, n_refusal, tokenizer = 1, "", None

    def __init__(self, model_name: str, session_id: str) -> None:
        self.model_name, self.session_id = model_name, session_id

    def _refuse(self) -> OpenAIError:
        return OpenAIError(
            f"unknown session {self.session_id!r}: use the base URL Relax gave the agent "
            "(RELAX_BASE_URL, http://HOST:PORT/s/<session>/v1) or the X-Relax-Session header",
            404,
        )

    async def chat_prompt(self, *_: Any) -> ChatPrompt:
        raise self._refuse()

    def text_prompt(self, *_: Any) -> list[int]:
        raise self._refuse()


class OpenAIServer:
    def __init__(
        self,
        model_name: str = "relax-policy",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        new_session: Callable[[str], ChatSession] | None = None,
        default_session: str | None = None,
        dependencies: Sequence[Any] = (),
        api_key: str | None = None,
    ) -> None:
        """`new_session(id)`: open a session for an unknown id (else a 404); `default_session`: the id of a
        request that names none (plain `/v1/...`), else such a request only lists the model."""
        self.model_name = model_name
        self.host, self.port = host, port
        self.new_session = new_session
        self.default_session = default_session
        self.sessions: dict[str, ChatSession] = {}
        self.session_tokens: dict[str, str] = {}  # session id -> the token its agent was given
        self.app = guard(self._build_app(list(dependencies)), api_key or process_token(), self._session_token)
        limit_requests(self.app)
        self._server: _Server | None = None
        self._task: Any = None
        self._starting: Any = None  # asyncio.Lock, made on the loop that starts the server

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_url(self, session_id: str) -> str:
        """What an OpenAI client takes as `base_url` for this session."""
        return f"{self.url}/s/{session_id}/v1"

    def open_session(self, session: ChatSession) -> None:
        self.sessions[session.session_id] = session

    def close_session(self, session_id: str) -> ChatSession | None:
        self.session_tokens.pop(session_id, None)
        return self.sessions.pop(session_id, None)

    def issue_token(self, session_id: str) -> str:
        """A fresh bearer token that opens session `session_id` alone (until it is closed)."""
        token = self.session_tokens[session_id] = secrets.token_urlsafe(24)
        register_secret(token)
        return token

    def _session_token(self, scope: dict[str, Any]) -> list[str]:
        path = scope.get("path", "")
        sid = path.split("/", 3)[2] if path.startswith("/s/") and path.count("/") >= 2 else ""
        if not sid:
            sid = next(
                (v.decode("latin-1") for k, v in scope.get("headers") or [] if k == SESSION_HEADER.encode()),
                "",
            )
        token = self.session_tokens.get(sid or self.default_session or "")
        return [token] if token else []

    async def start(self, timeout_s: float = 30.0) -> str:
        """Serve on the running event loop (port 0: a free one); returns the URL."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:  # concurrent first callers start one server
            if self._server is None:
                await self._serve(timeout_s)
        return self.url

    async def _serve(self, timeout_s: float) -> None:
        config = uvicorn.Config(
            self.app, host=self.host, port=self.port, log_level="warning", access_log=False,
            http=header_deadline_protocol(),  # a half-sent request head is timed out
        )  # fmt: skip
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
    def _resolve(self, request: Request) -> Any:
        sid = request.path_params.get("session_id") or request.headers.get(SESSION_HEADER, "")
        sid = sid or self.default_session or ""
        session = self.sessions.get(sid)
        if session is None and sid and self.new_session is not None:
            session = self.sessions[sid] = self.new_session(sid)
        return session if session is not None else _NoSession(self.model_name, sid)

    def _build_app(self, dependencies: list[Any]) -> FastAPI:
        app = FastAPI(title="Relax agent endpoint (OpenAI-compatible)")

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            return openai_error(f"invalid request: {exc.errors()[0].get('msg')}", 400)

        @app.get("/health")
        async def health() -> dict:  # liveness, answered without a token like every Relax server's
            return {}

        router = openai_router(self._resolve)
        app.include_router(router, prefix="/s/{session_id}/v1", dependencies=dependencies)
        app.include_router(router, prefix="/v1", dependencies=dependencies)
        return app
