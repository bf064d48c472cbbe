"""Trainer-side weight publishing, tagged with a version, over two transports chosen per receiver:

* **CUDA IPC** for a receiver on the same physical GPU as a training rank (colocated engines; the
  ActorFwd beside the trainer in fully_async): that rank packs each bucket on its GPU and sends the
  buffer's handle (`/update_weights_from_ipc`).
* **a broadcast group** for every other receiver (other GPUs, other hosts, CPU): rank 0 of the trainer
  is rank 0 of a `torch.distributed` group (NCCL between GPUs, gloo on CPU) with those receivers; each
  bucket travels as one flat buffer (`load_format="flattened_bucket"`) to Relax's own engines and
  receivers, or one broadcast per tensor where a receiver speaks only SGLang's protocol (`flatten=False`).

The receivers are matched to GPUs by the `device_uuid` their `/get_model_info` reports.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import torch

from relax.engine_api.client import EngineClient
from relax.engine_api.protocol import version_to_engine
from relax.utils.net import bind_address, free_port, node_ip
from relax.weights import ipc as weight_ipc
from relax.weights import sync_group as weight_sync
from relax.weights.sender import Named, SenderSettings

logger = logging.getLogger(__name__)


def local_uuid() -> str | None:
    """This process's current GPU (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return weight_ipc.device_uuid(torch.device("cuda", torch.cuda.current_device()))


def assign(
    receiver_uuids: Sequence[str | None], rank_uuids: Sequence[str | None]
) -> tuple[list[int], list[list[int]]]:
    """Receivers (by index) for the broadcast group, and per training rank the receivers it serves by
    CUDA IPC: a receiver goes to the first rank on its GPU, else to the group."""
    group: list[int] = []
    ipc: list[list[int]] = [[] for _ in rank_uuids]
    for i, u in enumerate(receiver_uuids):
        rank = next((r for r, ru in enumerate(rank_uuids) if u is not None and ru == u), None)
        (group if rank is None else ipc[rank]).append(i)
    return group, ipc


async def _uuid_of(client: EngineClient) -> str | None:
    try:
        return (await client.model_info()).get("device_uuid")
    except Exception as e:  # noqa: BLE001 - e.g. an SGLang server: it gets the group path
        logger.debug("no device uuid from %s: %s", client.base_url, e)
        return None


class WeightPublisher:
    def __init__(
        self,
        bucket_bytes: int = 256 << 20,
        group_name: str = weight_sync.WEIGHT_GROUP,
        backend: str = "auto",
        flatten: bool = True,
        ipc: bool = True,
        force_flat: bool = False,
        device: torch.device | None = None,
        host: str | None = None,
    ) -> None:
        """`backend`: nccl, gloo, or auto for the group: NCCL when the weights are on a GPU (`device`, the
        trainer's; None: whenever this process sees one), else gloo, so a trainer pinned to the CPU on a
        GPU host sends through gloo (NCCL cannot broadcast its host tensors).
        `flatten`: one NCCL broadcast per bucket (Relax receivers) instead of one per tensor (SGLang).
        gloo keeps one per tensor unless `force_flat`: its per-tensor sends overlap, a single large one
        does not (docs/measurements.md).
        `ipc`: serve receivers on this process's GPU by CUDA IPC.
        `host`: the address the group's rendezvous listens on, which the receivers connect to (this node's
        address on a cluster; default: Ray's node IP, loopback outside Ray)."""
        self.host = host
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.group_name = group_name
        self.device = device
        self.flatten, self.ipc, self.force_flat = flatten, ipc, force_flat
        self.group: weight_sync.WeightSyncGroup | None = None
        self.clients: list[EngineClient] = []  # members of the broadcast group
        self.ipc_clients: list[EngineClient] = []  # on this rank's GPU

    @classmethod
    def from_settings(cls, settings: SenderSettings, device: torch.device | None) -> WeightPublisher:
        """The rendezvous listens on `resources.bind`'s address in the process that sends (rank 0's node
        for a rank group)."""
        return cls(
            settings.bucket_bytes,
            backend=settings.backend,
            flatten=settings.flatten,
            ipc=settings.ipc,
            device=device,
            host=bind_address(settings.bind),
        )

    @property
    def connected(self) -> bool:
        return self.group is not None or bool(self.ipc_clients)

    async def connect(
        self, urls: list[str], rank_uuids: Sequence[str | None] | None = None, rank: int = 0
    ) -> None:
        """Split the receivers at `urls` between CUDA IPC (from the rank on their GPU) and the group, which
        rank 0 forms. `rank_uuids`: the GPU of every training rank (default: this process alone)."""
        await self.close()
        on_gpu = self.device.type == "cuda" if self.device is not None else torch.cuda.is_available()
        rank_uuids = list(rank_uuids) if rank_uuids is not None else [local_uuid() if on_gpu else None]
        clients = [EngineClient(u) for u in urls]
        if self.ipc and any(rank_uuids):
            uuids = await asyncio.gather(*(_uuid_of(c) for c in clients))
        else:
            uuids = [None] * len(clients)
        group, ipc = assign(uuids, rank_uuids)
        self.ipc_clients = [clients[i] for i in ipc[rank]]
        self.clients = [clients[i] for i in group] if rank == 0 else []
        for c in clients:
            if c not in self.clients and c not in self.ipc_clients:
                await c.close()
        if self.clients:
            backend = self.backend
            if backend == "auto":
                backend = "nccl" if on_gpu else "gloo"
            host = self.host or node_ip()
            self.group = await weight_sync.init_weight_sync(
                self.clients, host, free_port(host), backend=backend, group_name=self.group_name
            )
        logger.info(
            "weight sync (rank %d): %d receiver(s) in group %s (%s), %d by CUDA IPC",
            rank,
            len(self.clients),
            self.group_name,
            self.group.backend if self.group else "-",
            len(self.ipc_clients),
        )

    async def send_bucket(self, bucket: Named, version: int, last: bool) -> None:
        """Send one bucket to every receiver of this rank; the last bucket carries the version."""
        names = [n for n, _ in bucket]
        dtypes = [weight_sync.dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        tag = {"weight_version": version_to_engine(version) if last else None, "flush_cache": last}
        tasks = []
        shared = None
        if self.ipc_clients:
            device = torch.device("cuda", torch.cuda.current_device())
            shared = weight_ipc.pack(bucket, device)
            handle = weight_ipc.share(shared)
            tasks += [
                c.update_weights_from_ipc(names, dtypes, shapes, handle, **tag) for c in self.ipc_clients
            ]
        if self.group is not None:
            flat = self.flatten and (self.group.backend == "nccl" or self.force_flat)
            fmt = weight_ipc.FLAT if flat else None
            tasks += [
                c.update_weights_from_distributed(
                    names, dtypes, shapes, self.group.name, load_format=fmt, **tag
                )
                for c in self.clients
            ]
            if not flat:
                send = asyncio.to_thread(self.group.broadcast, [t for _, t in bucket])
            elif shared is not None and shared.device == self.group.device:
                send = asyncio.to_thread(self.group.broadcast_packed, shared)
            else:
                send = asyncio.to_thread(self.group.broadcast_flat, bucket)
            tasks.append(send)
        await weight_sync._all_or_first_error([asyncio.ensure_future(t) for t in tasks])  # noqa: SLF001
        del shared  # every IPC receiver has copied it

    async def close(self) -> None:
        """Leave the group; the members are asked to leave too (best effort: a dead engine cannot)."""
        if self.group is not None:
            calls = [
                asyncio.wait_for(c.destroy_weights_update_group(self.group.name), 10) for c in self.clients
            ]
            for c, r in zip(self.clients, await asyncio.gather(*calls, return_exceptions=True), strict=True):
                if isinstance(r, Exception):
                    logger.debug("%s did not leave weight-sync group %s: %s", c.base_url, self.group_name, r)
            await asyncio.to_thread(self.group.destroy)
            self.group = None
        for c in [*self.clients, *self.ipc_clients]:
            await c.close()
        self.clients, self.ipc_clients = [], []
