"""Listening sockets for the HTTP servers Relax starts itself (engine, elastic API)."""

from __future__ import annotations

import socket


def tcp_listener(host: str, port: int = 0) -> socket.socket:
    """A bound TCP socket for uvicorn's `sockets=`; `port=0` picks a free one (`getsockname()` tells).

    The socket is made with `IPPROTO_TCP` explicitly: asyncio turns Nagle's algorithm off (TCP_NODELAY)
    only on transports whose socket reports that protocol, and a plain `socket.socket(family,
    SOCK_STREAM)` reports 0. With Nagle on, a response's body waits for the ACK of its headers, which
    the client delays by 40 ms: every JSON answer took 44 ms on loopback, and a weight push paid it once
    per bucket. TCP_NODELAY is also set on the listener, which accepted connections inherit on Linux.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock
