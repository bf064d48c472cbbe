"""The small interface the Actor publishes weights through, and how a run picks its implementation:

* `WeightPublisher` (`relax.weights.publisher`): a `torch.distributed` broadcast group (NCCL on GPU,
  gloo on CPU) with CUDA IPC for receivers on the trainer's own GPU; the default.
* `DiskPublisher` (`relax.weights.disk`): safetensors files the engines load; for engines that cannot
  join a process group (`trainer.weight_sync_backend: disk`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch


class WeightSender(Protocol):
    connected: bool

    async def connect(self, urls: list[str]) -> None:
        """Receivers at `urls` (engines and other receivers) are the members from now on."""

    async def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Send the tensors tagged `version`; returns the seconds it took."""

    async def close(self) -> None:
        """Leave the members (best effort)."""


def build_sender(
    backend: str,
    *,
    bucket_bytes: int,
    flatten: bool,
    ipc: bool,
    device: torch.device | None,
    disk_root: str | Path,
    host: str | None = None,
) -> WeightSender:
    """`backend`: `disk` for files under `disk_root`; else the broadcast group (`auto`, `nccl`, `gloo`)
    with its rendezvous on `host`."""
    if backend == "disk":
        from relax.weights.disk import DiskPublisher

        return DiskPublisher(disk_root)
    from relax.weights.publisher import WeightPublisher

    return WeightPublisher(bucket_bytes, backend=backend, flatten=flatten, ipc=ipc, device=device, host=host)
