"""The elastic rollout REST API (FastAPI): scale out, scale in, operation status, cancel, engines.

The Rollout role serves it itself, with uvicorn on a background thread, because the roles' Serve
deployments run without Serve's HTTP proxy: the role keeps its router and engines on its own event loop
and the handlers hand every call over to that loop (`run_coroutine_threadsafe`), so the manager's state
is only ever touched from one loop. The URL goes to `<run_dir>/endpoints.json` (`elastic_api`), where
`relax status` finds it. The contract is docs/elastic_api.md; the OpenAPI document
docs/elastic_openapi.json is generated from this module (`python -m relax.fleet.elastic_api OUT.json`).

Errors are answered `{"error": {"message": ..., "type": ...}}`: 400 for a malformed or impossible
request, 404 for an unknown operation, 409 while another operation runs or when cancelling is no longer
possible, 422 for an idempotency key reused with a different request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from relax.fleet.elastic_ops import ElasticError, Operation
from relax.utils.auth import guard, process_token
from relax.utils.http_deadline import header_deadline_protocol
from relax.utils.http_limits import limit_requests
from relax.utils.net import tcp_listener

logger = logging.getLogger(__name__)
API_VERSION = "1"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str | None = Field(
        None, min_length=1, max_length=128, description="Idempotency key (the Idempotency-Key header wins)."
    )
    timeout_s: float | None = Field(
        None, gt=0, description="Deadline of the operation (default from config)."
    )


class ScaleOutRequest(_Body):
    mode: Literal["ray_native", "external"] = Field(
        ..., description="`ray_native`: Relax starts engines in its Ray cluster; `external`: attach by URL."
    )
    num_engines: int | None = Field(None, ge=1, description="ray_native: the engine count to reach.")
    engine_urls: list[str] | None = Field(
        None, min_length=1, description="external: base URLs of running engines (http://host:port)."
    )

    @model_validator(mode="after")
    def _one_target(self) -> ScaleOutRequest:
        if self.mode == "ray_native" and (self.num_engines is None or self.engine_urls):
            raise ValueError("mode ray_native takes num_engines (the engine count to reach), not engine_urls")
        if self.mode == "external":
            if self.engine_urls is None or self.num_engines is not None:
                raise ValueError("mode external takes engine_urls (running engines), not num_engines")
            bad = [u for u in self.engine_urls if not u.startswith(("http://", "https://"))]
            if bad:
                raise ValueError(f"engine_urls must be http(s)://host:port, got {bad}")
        return self


class ScaleInRequest(_Body):
    num_engines: int | None = Field(
        None, ge=1, description="The engine count to reach; the newest engines go first (last in, first out)."
    )
    engine_urls: list[str] | None = Field(None, min_length=1, description="The engines to remove, by URL.")

    @model_validator(mode="after")
    def _one_target(self) -> ScaleInRequest:
        if (self.num_engines is None) == (self.engine_urls is None):
            raise ValueError(
                "give exactly one of num_engines (count to reach) or engine_urls (engines to remove)"
            )
        return self


class StateChange(BaseModel):
    state: str
    at: float = Field(description="Unix time.")
    message: str


class OperationView(BaseModel):
    request_id: str = Field(description="The operation's id (the idempotency key when one was given).")
    kind: Literal["scale_out", "scale_in"]
    state: Literal[
        "pending", "creating", "connecting", "health_checking", "weight_syncing", "active",
        "draining", "removing", "completed", "failed", "cancelled",
    ]  # fmt: skip
    done: bool = Field(description="True in active, completed, failed and cancelled.")
    engines: list[str] = Field(description="URLs the operation adds or removes (known once chosen).")
    error: str | None = Field(description="Why it failed; it was rolled back.")
    message: str
    cancellable: bool
    request: dict[str, Any]
    timeout_s: float
    created_at: float
    updated_at: float
    history: list[StateChange]


class OperationList(BaseModel):
    operations: list[OperationView]


class EngineView(BaseModel):
    url: str
    origin: Literal["initial", "ray_native", "external"] = Field(description="initial engines are protected.")
    protected: bool
    state: Literal["joining", "active", "draining"]
    healthy: bool = Field(description="It answered /health just now.")
    routed: bool = Field(description="The router sends it requests.")
    outstanding: int = Field(description="Requests in flight on it.")
    served: int = Field(description="Requests it answered since it joined the router.")
    weight_version: str | None = Field(description="The weight version it reports.")
    in_weight_sync_group: bool


class EngineList(BaseModel):
    engines: list[EngineView]
    weight_version: str | None = Field(description="Version of the last weight push.")


class ErrorBody(BaseModel):
    message: str
    type: str


class ErrorView(BaseModel):
    error: ErrorBody


ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorView} for s in (400, 404, 409, 422)
}  # fmt: skip


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


def _validation_message(errors: list[dict[str, Any]]) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = str(e.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "invalid request: " + "; ".join(parts)


def build_app(manager: Any, loop: asyncio.AbstractEventLoop | None) -> FastAPI:
    """The API over `manager` (an `ElasticManager` living on `loop`)."""
    app = FastAPI(
        title="Relax elastic rollout API",
        version=API_VERSION,
        description="Scale the rollout's inference engines while training runs. See docs/elastic_api.md.",
    )

    async def call(coro: Any) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc.errors()), "invalid_request")

    @app.exception_handler(ElasticError)
    async def _refused(_: Request, exc: ElasticError) -> JSONResponse:
        return _error(exc.status, exc.message, type(exc).__name__)

    def _answer(op: Operation, created: bool) -> JSONResponse:
        return JSONResponse(op.to_dict(), status_code=202 if created else 200)

    def _args(body: _Body, key: str | None) -> tuple[dict[str, Any], str | None]:
        return body.model_dump(exclude={"request_id"}, exclude_none=True), key or body.request_id

    @app.get("/health", summary="The API answers")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(
        "/v1/engines/scale_out",
        response_model=OperationView,
        status_code=202,
        responses={200: {"model": OperationView, "description": "A repeated idempotent request"}, **ERRORS},
        summary="Add engines (asynchronous; poll the operation)",
    )
    async def scale_out(
        body: ScaleOutRequest, idempotency_key: str | None = Header(None, max_length=128)
    ) -> JSONResponse:
        return _answer(*await call(manager.scale_out(*_args(body, idempotency_key))))

    @app.post(
        "/v1/engines/scale_in",
        response_model=OperationView,
        status_code=202,
        responses={200: {"model": OperationView, "description": "A repeated idempotent request"}, **ERRORS},
        summary="Remove engines after draining them (asynchronous; poll the operation)",
    )
    async def scale_in(
        body: ScaleInRequest, idempotency_key: str | None = Header(None, max_length=128)
    ) -> JSONResponse:
        return _answer(*await call(manager.scale_in(*_args(body, idempotency_key))))

    @app.get("/v1/engines", response_model=EngineList, summary="Engines with their health")
    async def engines() -> dict[str, Any]:
        return {"engines": await call(manager.engines()), "weight_version": manager.version}

    @app.get("/v1/operations", response_model=OperationList, summary="Recent operations, oldest first")
    async def operations() -> dict[str, Any]:
        return {"operations": [op.to_dict() for op in await call(manager.operations())]}

    @app.get(
        "/v1/operations/{request_id}", response_model=OperationView, responses=ERRORS, summary="One operation"
    )
    async def operation(request_id: str) -> dict[str, Any]:
        return (await call(manager.get(request_id))).to_dict()

    @app.post(
        "/v1/operations/{request_id}/cancel",
        response_model=OperationView,
        responses=ERRORS,
        summary="Cancel a running operation; returns it after its rollback",
    )
    async def cancel(request_id: str) -> dict[str, Any]:
        return (await call(manager.cancel(request_id))).to_dict()

    return app


class ElasticServer:
    """The API on uvicorn in a daemon thread; `start()` returns the URL once it accepts requests."""

    def __init__(
        self,
        manager: Any,
        loop: asyncio.AbstractEventLoop,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ):
        """`api_key`: the bearer token every route but `/health` asks for; None = the run's token."""
        import uvicorn

        self.host, self.port = host, port
        self.app = limit_requests(guard(build_app(manager, loop), api_key or process_token()))
        self._uvicorn = uvicorn
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        sock = tcp_listener(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = self._uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off", loop="asyncio",
            http=header_deadline_protocol(),  # a half-sent request head is timed out
        )  # fmt: skip
        self._server = self._uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="relax-elastic-api", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"elastic API on {self.url} did not start; see the log above")
            time.sleep(0.02)
        logger.info("elastic rollout API at %s", self.url)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._server = self._thread = None


def record_endpoint(run_dir: str | Path, name: str, url: str) -> Path:
    """Add `name: url` to `<run_dir>/endpoints.json` (other entries kept; written atomically)."""
    path = Path(run_dir) / "endpoints.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[name] = url
    tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path


def openapi_document() -> dict[str, Any]:
    return build_app(None, None).openapi()


if __name__ == "__main__":  # python -m relax.fleet.elastic_api docs/elastic_openapi.json
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/elastic_openapi.json")
    out.write_text(json.dumps(openapi_document(), indent=2) + "\n")
    print(f"wrote {out}")
