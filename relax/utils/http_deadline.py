"""A deadline on reading a request's head (request line and headers) for every uvicorn server Relax
starts: `uvicorn.Config(app, http=header_deadline_protocol(), ...)`.

uvicorn times out only idle keep-alive connections, and only after a first response: a client that opens
a connection and sends nothing, or half a request line and then a header byte now and then (slowloris),
holds its socket and parser for ever, and enough such clients exhaust the server's file descriptors.
`RequestLimits` (`http_limits.py`) cannot help: it is ASGI middleware, and the app is called only once
the head is complete.

The protocol here is uvicorn's own (httptools when installed, else h11) with two additions, both for the
time between the first byte of a request (or the connection's opening) and the end of its head:

* a deadline of `header_timeout_s` for the whole head, not reset by further bytes (a client that sends a
  byte a second would otherwise keep resetting it): when it passes, the connection gets 408 and is
  closed;
* a bound of `max_head_bytes` on the head (h11 has one, httptools none): past it, 431 and closed.

Once the head is complete the request is the app's, with `RequestLimits` timing the body.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 20.0
DEFAULT_MAX_HEAD_BYTES = 64 * 1024


def _response(status: str) -> bytes:
    return f"HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".encode()


class _HeadDeadline:
    """Mixin over a uvicorn HTTP protocol class (its `cycle` is None or finished until a request's head
    has been parsed)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head():
            if self._head_timer is None:  # the first byte of the next request on a kept-alive connection
                self._arm_head_deadline()
            self._head_bytes += len(data)
        super().data_received(data)  # type: ignore[misc]
        if not self._awaiting_head():
            self._disarm_head_deadline()
        elif self._head_bytes > self.max_head_bytes:
            self._refuse("431 Request Header Fields Too Large")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_deadline()
        super().connection_lost(exc)  # type: ignore[misc]

    def _awaiting_head(self) -> bool:
        cycle = getattr(self, "cycle", None)
        return cycle is None or cycle.response_complete

    def _arm_head_deadline(self) -> None:
        self._disarm_head_deadline()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_deadline_passed)  # type: ignore[attr-defined]

    def _disarm_head_deadline(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
        self._head_timer = None
        self._head_bytes = 0

    def _head_deadline_passed(self) -> None:
        self._head_timer = None
        if self._awaiting_head():
            self._refuse("408 Request Timeout" if self._head_bytes else None)

    def _refuse(self, status: str | None) -> None:
        transport: asyncio.Transport = self.transport  # type: ignore[attr-defined]
        self._disarm_head_deadline()
        if transport.is_closing():
            return
        if status is not None:
            logger.info("closing a connection that sent an incomplete request head: %s", status)
            transport.write(_response(status))
        transport.close()


def header_deadline_protocol(
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
) -> Any:
    """uvicorn's default HTTP protocol class with the head deadline and size bound (for `uvicorn.Config`'s
    `http`)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    if header_timeout_s <= 0 or max_head_bytes <= 0:
        raise ValueError(
            f"limits must be positive, got header_timeout_s={header_timeout_s}, max_head_bytes={max_head_bytes}"
        )
    attrs = {"header_timeout_s": header_timeout_s, "max_head_bytes": max_head_bytes}
    return type("HeadDeadlineProtocol", (_HeadDeadline, AutoHTTPProtocol), attrs)
