"""The embedded engine's HTTP server on FastAPI: SGLang's native API (`/generate` with streaming and
log-probs, control, weights, info; see `relax.engine_api.protocol`) and the OpenAI-compatible API under
`/v1` (`relax.engine_api.openai`), so SGLang's own client, OpenAI clients and evaluation harnesses can
use a Relax engine or checkpoint.

The routes come from one `APIRouter` per group (`http_generate`, `http_info`, `http_control`, the
OpenAI router); `build_app(engine, dependencies=[...])` puts the same FastAPI dependencies on every
route but `/health` (the place for a bearer-token check).

`EngineServer` runs uvicorn in a background thread (it works inside a Ray actor: no signal handlers
off the main thread) and returns the bound port, so `port=0` picks a free one. Request bodies over
`max_body_bytes` are answered 413 before any route reads them (`relax.utils.http_limits`), and a request
head (request line and headers) not complete within `header_timeout_s` closes its connection
(`relax.utils.http_deadline`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.http.http_control import control_router
from relax.backends.inference.embedded.http.http_errors import bad_request, validation_message
from relax.backends.inference.embedded.http.http_generate import generate_router
from relax.backends.inference.embedded.http.http_info import health_router, info_router
from relax.backends.inference.embedded.http.openai_backend import EngineOpenAIBackend
from relax.data.reasoning import reasoning_style
from relax.engine_api.openai.errors import openai_error
from relax.engine_api.openai.routes import openai_router
from relax.utils.auth import guard, server_tokens
from relax.utils.http_deadline import DEFAULT_HEADER_TIMEOUT_S, header_deadline_protocol
from relax.utils.http_limits import DEFAULT_READ_TIMEOUT_S, limit_requests
from relax.utils.net import tcp_listener

logger = logging.getLogger(__name__)

# Above `http_limits`' generic 16 MiB: a multimodal prompt carries its media tensors base64-encoded in
# the JSON body, and a large image or a video can exceed 16 MiB legitimately.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024

__all__ = ["EngineServer", "bad_request", "build_app"]


def build_app(
    engine: EmbeddedEngine, dependencies: Sequence[Any] = (), reasoning_parser: str | None = None
) -> FastAPI:
    """The engine's app; `dependencies` (FastAPI `Depends(...)`) guard every route but `/health`;
    `reasoning_parser` splits `<think>` blocks from /v1 chat replies (`relax.data.reasoning`)."""
    app = FastAPI(title="relax embedded engine")
    deps = list(dependencies)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = f"invalid request: {validation_message(exc.errors())}"
        if request.url.path.startswith("/v1/") and "tokenize" not in request.url.path:
            return openai_error(message, 400)
        return bad_request(message)

    if reasoning_parser is not None:
        reasoning_style(reasoning_parser)  # an unknown name fails here, not on every request
    backend = EngineOpenAIBackend(engine, reasoning_parser=reasoning_parser)
    app.include_router(health_router(engine))
    for router in (generate_router(engine), info_router(engine), control_router(engine)):
        app.include_router(router, dependencies=deps)
    app.include_router(openai_router(lambda _request: backend), prefix="/v1", dependencies=deps)
    return app


class EngineServer:
    """An `EmbeddedEngine` behind its HTTP server on a background thread."""

    def __init__(
        self,
        model_path: str,
        host: str = "127.0.0.1",
        port: int = 0,
        dependencies: Sequence[Any] = (),
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        reasoning_parser: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """`api_key`: the bearer token every route but `/health` requires (None: none);
        `dependencies`: more FastAPI `Depends(...)` on those routes (see `build_app`);
        `max_body_bytes`: larger request bodies get 413 unread; `read_timeout_s`: a body that stops
        arriving for this long gets 408; `header_timeout_s`: a connection whose request head is not
        complete this long after its first byte gets 408 and is closed; `reasoning_parser`: the
        `<think>` style of /v1 chat replies (qwen3, deepseek-r1; None: not split)."""
        self.host, self.port = host, port
        self.header_timeout_s = header_timeout_s
        self.engine = EmbeddedEngine(model_path, **engine_kwargs)
        # its own engine key too: Relax's clients send that, never the run's token (relax/utils/auth.py)
        self.app = guard(
            build_app(self.engine, dependencies, reasoning_parser),
            api_key,
            server_tokens(api_key, lambda: self.url),
        )
        # added last, so outermost: an oversized body is refused before auth or routing touch it
        limit_requests(self.app, max_body_bytes, read_timeout_s)
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
            http=header_deadline_protocol(self.header_timeout_s),
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
