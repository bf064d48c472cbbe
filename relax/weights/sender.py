"""The one interface every trainer sends weights through, and the one place a run builds it.

A `WeightSender` takes buckets of full tensors (`send_bucket`), the version riding on the last one. The
one-process trainer (`relax.roles.actor`) hands it a whole model through `send_weights`; each rank of
the FSDP group (`relax.weights.rank_sender`) hands it the buckets it gathers. Which sender a run gets is
`trainer.weight_sync_backend`, looked up in `TRANSPORTS`:

* `auto`, `nccl`, `gloo`: `WeightPublisher` (`relax.weights.publisher`), a `torch.distributed`
  broadcast group with CUDA IPC for receivers on the trainer's own GPU;
* `disk`: `DiskPublisher` (`relax.weights.disk`), safetensors files the engines load, for engines that
  cannot join a process group.

A new transport is a module with a class that has `from_settings` and the `WeightSender` methods, and
its name in `TRANSPORTS` (docs/trainer.md, "Adding a weight transport").
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from relax.config import TrainerConfig

Named = list[tuple[str, Tensor]]

# trainer.weight_sync_backend -> "module:Class" of its sender (imported when a run picks it)
TRANSPORTS: dict[str, str] = {
    "auto": "relax.weights.publisher:WeightPublisher",
    "nccl": "relax.weights.publisher:WeightPublisher",
    "gloo": "relax.weights.publisher:WeightPublisher",
    "disk": "relax.weights.disk:DiskPublisher",
}


class WeightSender(Protocol):
    connected: bool
    bucket_bytes: int  # the most bytes of tensors `send_weights` puts in one bucket

    async def connect(
        self, urls: list[str], rank_uuids: Sequence[str | None] | None = None, rank: int = 0
    ) -> None:
        """Receivers at `urls` (engines, ActorFwd's receiver) are the members from now on. A rank of a
        group passes every rank's GPU (`rank_uuids`) and its own `rank`."""

    async def send_bucket(self, bucket: Named, version: int, last: bool) -> None:
        """Send one bucket to this sender's receivers; the last bucket of a push carries `version`."""

    async def close(self) -> None:
        """Leave the members (best effort)."""


@dataclass(frozen=True)
class SenderSettings:
    """What builds a sender: `trainer.weight_sync_*` and `resources.bind`. Plain values, so it travels
    to the rank processes, which build their sender where they run."""

    backend: str = "auto"
    bucket_bytes: int = 256 << 20
    flatten: bool = True
    ipc: bool = True
    bind: str = "auto"  # `resources.bind`: where a broadcast group's rendezvous listens
    disk_root: str = "weights"  # the `disk` transport's folder

    @classmethod
    def from_config(cls, trainer: TrainerConfig, bind: str, disk_root: str = "weights") -> SenderSettings:
        return cls(
            backend=trainer.weight_sync_backend,
            bucket_bytes=trainer.publish_bucket_mb << 20,
            flatten=trainer.weight_sync_flatten is not False,
            ipc=trainer.weight_sync_ipc,
            bind=bind,
            disk_root=str(disk_root),
        )


def build_sender(settings: SenderSettings, device: torch.device | None = None) -> WeightSender:
    """The sender `settings.backend` names, for weights on `device` (None: this process's GPU if any)."""
    if settings.backend not in TRANSPORTS:
        raise ValueError(
            f"unknown trainer.weight_sync_backend {settings.backend!r}; use one of {sorted(TRANSPORTS)}"
        )
    module, name = TRANSPORTS[settings.backend].split(":")
    cls: Any = getattr(importlib.import_module(module), name)
    return cls.from_settings(settings, device)


def stream_buckets(named: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[tuple[Named, bool]]:
    """(bucket, is_last) over consecutive buckets of at most `bucket_bytes` (a bigger tensor goes alone).
    One bucket is held back to know which is the last: the version travels with the last bucket only, so
    a receiver reports the new version once it holds all of it."""
    current: Named = []
    size = 0
    pending: Named | None = None
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > bucket_bytes:
            if pending is not None:
                yield pending, False
            pending, current, size = current, [], 0
        current.append((name, t))
        size += nbytes
    if pending is not None:
        yield pending, not current
    if current:
        yield current, True


async def send_weights(
    sender: WeightSender, named: Iterable[tuple[str, Tensor]], version: int
) -> dict[str, float]:
    """Send all tensors, bucket by bucket, as version `version`; returns bytes and seconds."""
    if not sender.connected:
        raise RuntimeError(f"{type(sender).__name__}: weights sent before connect(): no receivers to send to")
    t0 = time.perf_counter()
    nbytes = 0
    for bucket, last in stream_buckets(named, sender.bucket_bytes):
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        await sender.send_bucket(bucket, version, last)
    return {"perf/weight_sync_bytes": float(nbytes), "perf/weight_publish_s": time.perf_counter() - t0}
