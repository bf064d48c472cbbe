"""Request-body size limit for any ASGI server (FastAPI: `app.add_middleware(BodySizeLimit, max_bytes=...)`).

Without one, a single client that posts a huge body makes the server buffer all of it in memory before a
route even sees it: one bad request can exhaust the process. `BodySizeLimit` answers 413 instead, from
the `Content-Length` header when there is one (nothing is read), else by counting the streamed chunks
(chunked transfer encoding) and stopping at the first one past the limit.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


class BodySizeLimit:
    """ASGI middleware: HTTP requests whose body exceeds `max_bytes` get 413 (JSON error body)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._reject(send, declared)  # the body is never read
            return
        seen = 0
        rejected = False
        started = False

        async def limited_receive() -> Message:
            nonlocal seen, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Answer now and tell the app the client left: it stops reading, and whatever it
                    # sends afterwards (its own error for the "disconnect") is dropped below.
                    rejected = True
                    if not started:
                        await self._reject(send, None)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not rejected:  # the app's own error, not the disconnect this middleware caused
                raise

    async def _reject(self, send: Send, declared: int | None) -> None:
        size = f" ({declared} bytes)" if declared is not None else ""
        body = json.dumps(
            {
                "error": {
                    "message": f"request body too large{size}; the limit is {self.max_bytes} bytes",
                    "code": 413,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),  # the unread rest of the body makes the connection unusable
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    """The request's declared body size; None when absent or unparsable (then the stream is counted)."""
    headers: list[tuple[bytes, Any]] = scope.get("headers") or []
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


DEFAULT_READ_TIMEOUT_S = 30.0


class ReadTimeout:
    """ASGI middleware: a client that stops sending its request body for `timeout_s` gets 408 and the
    request ends, instead of holding its connection and its handler open for ever (a half-sent request).

    Only reads of the body are timed: once the body is complete, `receive` passes through untouched, so
    a streaming response that waits for the client's disconnect is not cut off."""

    def __init__(self, app: ASGIApp, timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False
        timed_out = False
        started = False

        async def timed_receive() -> Message:
            nonlocal body_done, timed_out
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
                if not started:
                    await _send_error(send, 408, f"request body not received within {self.timeout_s:g}s")
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if timed_out:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:
            if not timed_out:
                raise


async def _send_error(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def limit_requests(
    app: Any, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
) -> Any:
    """`app` (FastAPI/Starlette) with the body size limit and the body read timeout; returns `app`.
    Every server Relax starts goes through here."""
    app.add_middleware(ReadTimeout, timeout_s=read_timeout_s)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)  # outermost: an oversized body is never read
    return app
