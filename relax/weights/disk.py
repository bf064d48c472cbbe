"""Weight sync through files: the fallback for engines that cannot join a process group
(ARCHITECTURE.md, "The weight push"). Each publish writes the weights as one safetensors file in a folder of its version under
`root`, then asks every engine to load it (`/update_weights_from_disk`); engines on other nodes need
`root` on storage they see (the run folder on a cluster is shared: docs/cluster.md).

The file is written under a temporary name and renamed, so an engine never loads half a file; the two
newest versions are kept (a retried push may still read the one before).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from relax.engine_api.client import EngineClient
from relax.engine_api.protocol import version_to_engine

logger = logging.getLogger(__name__)

KEEP_VERSIONS = 2


def save_weights(named_tensors: Iterable[tuple[str, Tensor]], out_dir: str | Path) -> Path:
    """Write `model.safetensors` in `out_dir` (made if missing) atomically; returns the folder."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors: dict[str, Tensor] = {}
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:  # tied weights share storage; safetensors refuses shared tensors
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    return out


class DiskPublisher:
    """`WeightSender` over files in `root`: `connect` names the engines, `publish` writes and loads."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.clients: list[EngineClient] = []

    @property
    def connected(self) -> bool:
        return bool(self.clients)

    async def connect(self, urls: list[str]) -> None:
        await self.close()
        self.clients = [EngineClient(u) for u in urls]
        logger.info("weight sync by files under %s to %d engine(s)", self.root, len(self.clients))

    async def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> float:
        """Write version `version` and have every engine load it; returns the seconds it took."""
        if not self.connected:
            raise RuntimeError("DiskPublisher.publish before connect(): no engines to publish to")
        t0 = time.perf_counter()
        folder = await asyncio.to_thread(save_weights, named_tensors, self.root / f"v{version:06d}")
        await asyncio.gather(
            *(
                c.update_weights_from_disk(str(folder), weight_version=version_to_engine(version))
                for c in self.clients
            )
        )
        for old in sorted(self.root.glob("v[0-9]*"))[:-KEEP_VERSIONS]:
            shutil.rmtree(old, ignore_errors=True)
        return time.perf_counter() - t0

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        self.clients = []
