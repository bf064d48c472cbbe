"""Request limits for any ASGI server Relax starts: a body size limit and a body read timeout.

Without them one client can exhaust or stall a server: a huge body is buffered whole before a route
sees it, and a client that sends half a request and then nothing holds its connection and handler open
for ever. `RequestLimits` answers instead:

* 413 for a body over `max_bytes`, from `Content-Length` when there is one (nothing is read), else by
  counting the streamed chunks and stopping at the first one past the limit;
* 408 when the body stops arriving for `read_timeout_s`. Only reads of the body are timed: once it is
  complete, `receive` passes through untouched, so a streaming response that waits for the client's
  disconnect is not cut off.

After a body of `TRIM_AFTER_BYTES` or more, the memory freed is handed back to the OS
(`release_freed_memory`), so a large request, served or refused, does not leave the server larger.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import json
import threading
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_READ_TIMEOUT_S = 30.0
# After a body this large, freed memory is handed back to the OS (`release_freed_memory`)
TRIM_AFTER_BYTES = 8 * 1024 * 1024
TRIM_EVERY_S = 5.0  # at most one trim this often (it walks the whole heap); later ones wait their turn
_trim_lock = threading.Lock()
_trim_pending = False
_last_trim = float("-inf")


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the OS soon (glibc's `malloc_trim`, on a timer thread; a no-op
    elsewhere). Once a large request body has been parsed and dropped, glibc keeps its buffers: after
    freeing a large block it raises its mmap threshold, so the next large ones come from the heap, and
    stay there once freed, and a server's memory grows by several bodies' worth for good."""
    global _trim_pending
    trim = _malloc_trim()
    if trim is None:
        return
    with _trim_lock:
        if _trim_pending:  # the pending trim runs after this body was freed too
            return
        _trim_pending = True
        delay = max(0.0, _last_trim + TRIM_EVERY_S - time.monotonic())
    timer = threading.Timer(delay, _run_trim, args=(trim,))
    timer.daemon = True
    timer.start()


def _run_trim(trim: Any) -> None:
    global _trim_pending, _last_trim
    with _trim_lock:
        _trim_pending = False
        _last_trim = time.monotonic()
    trim(0)


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


class RequestLimits:
    """ASGI middleware: 413 for a body over `max_bytes`, 408 for a body that stalls `read_timeout_s`."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = DEFAULT_MAX_BODY_BYTES,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    ) -> None:
        if max_bytes <= 0 or read_timeout_s <= 0:
            raise ValueError(
                f"limits must be positive, got max_bytes={max_bytes}, read_timeout_s={read_timeout_s}"
            )
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _send_error(send, 413, self._too_large(declared))  # the body is never read
            return
        seen, body_done, cut, started = 0, False, False, False

        async def limited_receive() -> Message:
            nonlocal seen, body_done, cut
            if cut:
                return {"type": "http.disconnect"}
            if body_done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                return await refuse(408, f"request body not received within {self.read_timeout_s:g}s")
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    return await refuse(413, self._too_large(None))
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def refuse(status: int, reason: str) -> Message:
            # Answer now and tell the app the client left: it stops reading, and whatever it sends
            # afterwards (its own error for the "disconnect") is dropped by `guarded_send`.
            nonlocal cut
            cut = True
            if not started:
                await _send_error(send, status, reason)
            return {"type": "http.disconnect"}

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if cut:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not cut:  # the app's own error, not the disconnect this middleware caused
                raise
        finally:
            if seen >= TRIM_AFTER_BYTES:
                release_freed_memory()

    def _too_large(self, declared: int | None) -> str:
        size = f" ({declared} bytes)" if declared is not None else ""
        return f"request body too large{size}; the limit is {self.max_bytes} bytes"


async def _send_error(send: Send, status: int, message: str) -> None:
    body = json.dumps({"error": {"message": message, "code": status}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),  # the unread rest of the body makes the connection unusable
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
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


def limit_requests(
    app: Any, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
) -> Any:
    """`app` (FastAPI/Starlette) with `RequestLimits` as its outermost middleware (an oversized body is
    refused before authentication or routing touch it); returns `app`. Every server Relax starts goes
    through here."""
    app.add_middleware(RequestLimits, max_bytes=max_body_bytes, read_timeout_s=read_timeout_s)
    return app
