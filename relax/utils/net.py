"""Addresses and sockets of the servers Relax starts itself (engines, receivers, elastic API, weight-sync
rendezvous): this node's address, a free port, a bound listener."""

from __future__ import annotations

import socket


def tcp_listener(host: str, port: int = 0) -> socket.socket:
    """A bound TCP socket for uvicorn's `sockets=`; `port=0` picks a free one (`getsockname()` tells).

    The socket is made with `IPPROTO_TCP` explicitly: asyncio turns Nagle's algorithm off (TCP_NODELAY)
    only on transports whose socket reports that protocol, and a plain `socket.socket(family,
    SOCK_STREAM)` reports 0. With Nagle on, a response's body waits for the ACK of its headers, which
    the client delays: every JSON answer waited for it, and a weight push paid that once per bucket
    (docs/measurements.md). TCP_NODELAY is also set on the listener, which accepted connections inherit on Linux.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    """This node's address as Ray knows it (the one other nodes reach it on); loopback outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray the loopback address is right
        pass
    return "127.0.0.1"


def resolve_bind(bind: str = "auto") -> str:
    """`resources.bind` as `loopback` or `node`: `auto` is `node` when this process's Ray cluster has more
    than one live node, else `loopback` (also outside Ray)."""
    if bind != "auto":
        return bind
    try:
        import ray

        if ray.is_initialized() and sum(1 for n in ray.nodes() if n.get("Alive")) > 1:
            return "node"
    except Exception:  # noqa: BLE001 - no cluster to ask: one machine
        pass
    return "loopback"


def bind_address(bind: str = "auto") -> str:
    """The address a server Relax starts listens on and advertises (`resources.bind`): 127.0.0.1, or
    this node's address (Ray's node IP) on a cluster of several nodes. Never all interfaces."""
    return "127.0.0.1" if resolve_bind(bind) == "loopback" else node_ip()
