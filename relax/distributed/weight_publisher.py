"""Trainer-side weight publishing: one `torch.distributed` group with the trainer as rank 0 and every
engine as ranks 1..N; each publish broadcasts the weights in buckets, tagged with a version.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterable

import torch

from relax.backends.inference.client import EngineClient
from relax.distributed import weight_sync

logger = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray the loopback address is right
        pass
    return "127.0.0.1"


class WeightPublisher:
    def __init__(
        self, bucket_bytes: int = 256 << 20, group_name: str = "relax_weights", backend: str = "auto"
    ) -> None:
        """`backend`: nccl, gloo, or auto (NCCL when this process sees a GPU, else gloo). Engines that share
        a GPU with the trainer need gloo: NCCL refuses two ranks of one communicator on one GPU."""
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.group_name = group_name
        self.group = None
        self.clients: list[EngineClient] = []
        self.last_publish_s = 0.0

    async def connect(self, urls: list[str]) -> None:
        """Form the weight-sync group with the engines at `urls` (each joins through its HTTP API)."""
        await self.close()
        backend = self.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.clients = [EngineClient(u) for u in urls]
        self.group = await weight_sync.init_weight_sync(
            self.clients, node_ip(), free_port(), backend=backend, group_name=self.group_name
        )
        logger.info("weight-sync group %s: trainer + %d engines (%s)", self.group_name, len(urls), backend)

    async def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Broadcast all tensors to the engines; returns the seconds it took."""
        if self.group is None:
            raise RuntimeError("WeightPublisher.publish before connect(): no engines to publish to")
        t0 = time.perf_counter()
        await weight_sync.push_weights(
            self.group, self.clients, list(named_tensors), version, bucket_bytes=self.bucket_bytes
        )
        self.last_publish_s = time.perf_counter() - t0
        return self.last_publish_s

    async def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None
        for c in self.clients:
            await c.close()
        self.clients = []
