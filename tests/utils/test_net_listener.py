"""Relax's own HTTP servers answer without Nagle's delay: their sockets carry TCP_NODELAY."""

from __future__ import annotations

import asyncio
import socket

from relax.utils.net import tcp_listener


def test_listener_is_tcp_with_nodelay():
    sock = tcp_listener("127.0.0.1")
    try:
        assert sock.proto == socket.IPPROTO_TCP  # asyncio sets TCP_NODELAY only on such sockets
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_asyncio_server_connections_have_nodelay():
    """The accepted connection a server built on the listener writes through has Nagle off."""
    seen: list[int] = []

    async def main() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = tcp_listener("127.0.0.1")
        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0]
