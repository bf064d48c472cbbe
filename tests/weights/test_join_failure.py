"""A weight-sync group whose formation fails on one member leaves no other member stuck in its
rendezvous: the group formed again without that member succeeds at once (an engine refuses a second
join while one is in progress, as the embedded engine's `/init_weights_update_group` does with 409)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from relax.utils.net import free_port
from relax.weights.sync_group import create_group, init_weight_sync


class Member:
    """An engine's side of the group, joined on a thread like the engine's server does."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.joining = threading.Lock()
        self.group = None

    async def init_weights_update_group(self, address, port, rank, world_size, group_name, backend) -> dict:
        if self.refuse:
            raise RuntimeError("init_weights_update_group failed: refused")
        if not self.joining.acquire(blocking=False):
            raise RuntimeError("409: a weight-update group join is already in progress")
        try:
            if self.group is not None:
                self.group.destroy()
            self.group = await asyncio.to_thread(
                create_group, address, port, rank, world_size, backend, group_name, 30.0
            )
        finally:
            self.joining.release()
        return {"success": True}


def test_a_refusing_member_fails_the_formation_alone():
    good, bad = Member(), Member(refuse=True)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="refused"):
            await init_weight_sync([good, bad], "127.0.0.1", free_port(), group_name="t_join")
        assert not good.joining.locked()  # its rendezvous completed: it may join again
        group = await init_weight_sync([good], "127.0.0.1", free_port(), group_name="t_join")
        try:
            sent = torch.arange(4, dtype=torch.float32)
            recv = asyncio.create_task(asyncio.to_thread(good.group.receive, [("t", torch.float32, [4])]))
            await asyncio.to_thread(group.broadcast, [sent])
            got = (await recv)["t"]
            assert torch.equal(got, sent)
        finally:
            group.destroy()
            good.group.destroy()

    asyncio.run(main())


def test_the_rendezvous_socket_has_one_owner():
    """The store closes its listening socket when it goes; no Python socket object may hold the same
    number too (it would close it a second time, and by then the number can be another group's socket)."""
    import gc
    import socket

    import psutil

    port = free_port()
    group = create_group("127.0.0.1", port, 0, 1, group_name="t_owner")
    try:
        listening = [
            c.fd
            for c in psutil.Process().net_connections("tcp")
            if c.laddr.port == port and c.status == "LISTEN"
        ]
        assert listening, "the store does not listen on its port"
        owners = [s for s in gc.get_objects() if isinstance(s, socket.socket) and s.fileno() in listening]
        assert not owners, owners
    finally:
        group.destroy()
