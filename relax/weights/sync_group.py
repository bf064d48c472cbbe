"""Weight sync: versioned tensors from the trainer (rank 0) to inference engines (ranks 1..N).

Two transports, one contract (the engine loads tensors by Hugging Face name and reports the version):

* a standalone `torch.distributed` group, built from a `TCPStore` and the backend's ProcessGroup class
  (gloo on CPU, NCCL on GPU, the same code). It never touches the default group, so a trainer may keep
  its own FSDP group. Store keys follow `torch.distributed`'s own group helper as SGLang uses it
  (`<group>` / `<group>/` / `<device>/` prefixes over the store), so the trainer side also works with
  real SGLang engines; one broadcast per tensor, in the order the engines were told.
* safetensors on disk (`relax.weights.disk`) for engines that cannot join a process group.

Sender sequence (`push_weights`): per bucket, start `/update_weights_from_distributed` on every engine
(they begin receiving), broadcast the bucket, then await the HTTP answers. The version is sent with the
last bucket only, so an engine reports the new version once it holds all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from relax.utils.net import route_address

logger = logging.getLogger(__name__)

TensorSpec = tuple[str, torch.dtype | str, Sequence[int]]  # (name, dtype, shape)
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}
WEIGHT_GROUP = "relax_weights"  # the name of the trainer's group (receivers leave it by name)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the spelling SGLang's `getattr(torch, dtype)` accepts)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use names like float32 or bfloat16")
    return value


def _bcast_opts(src: int) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    return opts


class WeightSyncGroup:
    """A process group of the trainer (rank 0) and the engines; holds no reference to the default group."""

    def __init__(
        self,
        pg: Any,
        store: dist.Store,
        rank: int,
        world_size: int,
        backend: str,
        name: str,
        device: torch.device,
    ) -> None:
        self.pg, self.store, self.rank, self.world_size = pg, store, rank, world_size
        self.backend, self.name = backend, name
        self.device = device  # where tensors travel: cpu for gloo, this rank's GPU for nccl

    def _on_device(self) -> Any:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def broadcast(self, tensors: Iterable[Tensor], src: int = 0) -> None:
        """Sender side: one broadcast per tensor, in order (the receivers expect exactly this order)."""
        works = []
        with self._on_device():
            for t in tensors:
                t = t.detach().to(self.device).contiguous()
                works.append((t, self.pg.broadcast([t], _bcast_opts(src))))
            for _, w in works:
                w.wait()

    def broadcast_flat(self, tensors: Sequence[tuple[str, Tensor]], src: int = 0) -> None:
        """Sender side of `load_format="flattened_bucket"`: the bucket packed into one buffer, one broadcast."""
        from relax.weights.ipc import pack

        with self._on_device():
            self.broadcast_packed(pack(tensors, self.device), src)

    def broadcast_packed(self, buf: Tensor, src: int = 0) -> None:
        """Broadcast a buffer that `weight_ipc.pack` made on this group's device."""
        with self._on_device():
            self.pg.broadcast([buf], _bcast_opts(src)).wait()

    def receive_flat(self, specs: Sequence[TensorSpec], src: int = 0) -> dict[str, Tensor]:
        """Receiver side of `broadcast_flat`: one buffer, returned as views by name."""
        from relax.weights.ipc import layout, unpack

        typed = [(n, parse_dtype(d), s) for n, d, s in specs]
        with self._on_device():
            buf = torch.empty(layout(typed)[1], dtype=torch.uint8, device=self.device)
            self.pg.broadcast([buf], _bcast_opts(src)).wait()
        return unpack(buf, typed)

    def receive(self, specs: Sequence[TensorSpec], src: int = 0) -> dict[str, Tensor]:
        """Receiver side: allocate each (name, dtype, shape) on the group's device and receive it."""
        out: dict[str, Tensor] = {}
        works = []
        with self._on_device():
            for name, dtype, shape in specs:
                t = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=self.device)
                works.append(self.pg.broadcast([t], _bcast_opts(src)))
                out[name] = t
            for w in works:
                w.wait()
        return out

    def destroy(self, timeout_s: float = 10.0) -> None:
        """Leave the group without waiting for the peers: an NCCL communicator is aborted (a graceful
        NCCL shutdown blocks while a peer still holds the communicator, e.g. an engine that keeps its
        side of the group until the next `/init_weights_update_group`). Never blocks past `timeout_s`."""
        pg, self.pg = self.pg, None
        if pg is None:
            return

        def end() -> None:
            try:
                if self.backend == "nccl" and hasattr(pg, "abort"):
                    pg.abort()
                else:
                    pg.shutdown()
            except Exception as e:  # noqa: BLE001 - best effort; the group may already be broken
                logger.debug("weight-sync group %s shutdown: %s", self.name, e)

        t = threading.Thread(target=end, name=f"destroy-{self.name}", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            logger.warning(
                "weight-sync group %s did not shut down within %.0fs; left behind", self.name, timeout_s
            )


def create_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    group_name: str = "weight_update_group",
    timeout_s: float = 600.0,
    device: str | torch.device | None = None,
) -> WeightSyncGroup:
    """Join (rank 0: host) a weight-sync group; blocks until all `world_size` ranks have joined.

    `device`: where tensors travel; default cpu for gloo, the current GPU for nccl (pass the engine's GPU).
    """
    if backend not in BACKEND_DEVICE:
        raise ValueError(f"unknown weight-sync backend {backend!r}; use gloo (CPU) or nccl (GPU)")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend nccl needs a GPU; use backend gloo on CPU hosts")
    device_type = BACKEND_DEVICE[backend]
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
    elif torch.device(device).type != device_type:
        raise ValueError(f"backend {backend} moves tensors on {device_type}, not on {device}")
    timeout = timedelta(seconds=timeout_s)
    listener = _store_listener(master_address, master_port) if rank == 0 else None
    # The store takes the socket over and closes it when it goes: a socket object kept beside it closed the
    # same number a second time, which, once the number was reused, closed another group's rendezvous
    # socket (seen as "Failed to open existing socket ... ENOTSOCK" while tests ran side by side)
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=(rank == 0),
        timeout=timeout,
        multi_tenant=True,
        master_listen_fd=None if listener is None else listener.detach(),
    )
    # The same prefixes as torch.distributed's group helper under SGLang's init_custom_process_group.
    prefixed = dist.PrefixStore(
        f"{device_type}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    )
    if backend == "gloo":
        # Gloo's default device is the address this host's name resolves to, loopback on many hosts:
        # peers on other nodes could not connect to it. The address on the route to the rendezvous is
        # the one they reach.
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=route_address(master_address))]
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    logger.info("weight-sync group %s: rank %d of %d joined (%s)", group_name, rank, world_size, backend)
    group = WeightSyncGroup(pg, store, rank, world_size, backend, group_name, torch.device(device))
    return group


def _store_listener(address: str, port: int) -> socket.socket | None:
    """The rendezvous store's listening socket, bound to `address` alone: TCPStore's own server listens
    on every interface, and the rendezvous address is the only one its peers use (127.0.0.1 on one
    machine, the trainer node's address on a cluster). None where `address` is not this host's (the
    store then binds as it would)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        logger.warning(
            "weight-sync rendezvous: cannot bind %s:%d (%s); the store binds every interface",
            address,
            port,
            e,
        )
        return None
    return sock


STAND_IN_TIMEOUT_S = 60.0  # the most a failed formation waits for its other members to finish joining


async def init_weight_sync(
    engine_clients: Sequence[Any],
    master_address: str,
    master_port: int,
    backend: str = "gloo",
    group_name: str = "weight_update_group",
    timeout_s: float = 600.0,
) -> WeightSyncGroup:
    """Trainer side: ask every engine to join as ranks 1..N while joining as rank 0 here.

    A member that refuses (or cannot be reached) would leave the others waiting in the rendezvous until
    their join times out, refusing any new join meanwhile (`409 a weight-update group join is already in
    progress`): the group formed again without it would fail too. So the trainer joins in place of each
    failed member (`_stand_in`), the rendezvous completes, and the group is dropped at once; the
    members are free for the next formation. Then the first failure is raised."""
    world_size = len(engine_clients) + 1
    calls = [
        asyncio.create_task(
            c.init_weights_update_group(master_address, master_port, i + 1, world_size, group_name, backend)
        )
        for i, c in enumerate(engine_clients)
    ]
    join = asyncio.create_task(
        asyncio.to_thread(
            create_group, master_address, master_port, 0, world_size, backend, group_name, timeout_s
        )
    )
    done, _ = await asyncio.wait([join, *calls], return_when=asyncio.FIRST_EXCEPTION)
    failed = [t for t in done if t.exception() is not None]
    if not failed:
        return join.result()
    error = failed[0].exception()
    if join in failed:  # without rank 0 nothing completes: stop asking
        for t in calls:
            t.cancel()
        raise error
    await _stand_in(join, calls, master_address, master_port, world_size, backend, group_name)
    raise error


async def _stand_in(
    join: asyncio.Task,
    calls: list[asyncio.Task],
    master_address: str,
    master_port: int,
    world_size: int,
    backend: str,
    group_name: str,
) -> None:
    """Complete a rendezvous whose members failed: join as each of them, wait (bounded) for everyone,
    and leave the group at once. The members that did join hold a group nobody sends on; their next
    `/init_weights_update_group` replaces it."""
    ranks = [i + 1 for i, t in enumerate(calls) if t.done() and t.exception() is not None]
    logger.warning(
        "weight-sync group %s: rank(s) %s failed to join; joining in their place so that the others "
        "finish their rendezvous and can join again",
        group_name,
        ranks,
    )
    stand_ins = [
        asyncio.create_task(
            asyncio.to_thread(
                create_group,
                master_address,
                master_port,
                r,
                world_size,
                backend,
                group_name,
                STAND_IN_TIMEOUT_S,
            )
        )
        for r in ranks
    ]
    everyone = [join, *calls, *stand_ins]
    await asyncio.wait(everyone, timeout=STAND_IN_TIMEOUT_S)
    for t in [join, *stand_ins]:
        if t.done() and t.exception() is None:
            await asyncio.to_thread(t.result().destroy)
        elif t.done():
            logger.debug("weight-sync group %s: a stand-in join failed: %s", group_name, t.exception())
    for t in calls:
        if not t.done():
            t.cancel()


async def _all_or_first_error(tasks: list[asyncio.Task]) -> None:
    """Await all tasks; on the first failure cancel the rest and raise it (a broadcast thread blocked on a
    dead peer ends at the group's timeout)."""
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in done:
        if t.exception() is not None:
            for p in pending:
                p.cancel()
            raise t.exception()


def without_tied(named: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """Drop each tensor that is a view of the same memory as one kept before it: the LM head of a
    tied-embedding model (`lm_head.weight` is `embed_tokens.weight`). Receivers tie them the same way
    (the transformers model class at load; SGLang skips `lm_head.weight` under `tie_word_embeddings`),
    so the embedding alone updates both; sending the head again is a sizeable share of a small model's
    push (docs/measurements.md)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = []
    for name, t in named:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out.append((name, t))
    return out
