"""Weight sync through files: the fallback for engines that cannot join a process group
(ARCHITECTURE.md, "The weight push"). Each push writes the weights as one safetensors file in a folder of its version under
`root`, then asks every engine to load it (`/update_weights_from_disk`); engines on other nodes need
`root` on storage they see (the run folder on a cluster is shared: docs/cluster.md).

The file is written under a temporary name and renamed, so an engine never loads half a file; the two
newest versions are kept (a retried push may still read the one before).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from relax.engine_api.client import EngineClient
from relax.engine_api.protocol import version_to_engine
from relax.weights.sender import Named, SenderSettings

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
    """`WeightSender` over files in `root`: `connect` names the engines; the buckets of a push are
    collected, and the last one writes the version and has every engine load it."""

    def __init__(self, root: str | Path, bucket_bytes: int = 256 << 20) -> None:
        self.root = Path(root)
        self.bucket_bytes = bucket_bytes
        self.clients: list[EngineClient] = []
        self._pending: list[tuple[str, Tensor]] = []  # the buckets of the push in progress

    @classmethod
    def from_settings(cls, settings: SenderSettings, device: torch.device | None = None) -> DiskPublisher:
        return cls(settings.disk_root, settings.bucket_bytes)

    @property
    def connected(self) -> bool:
        return bool(self.clients)

    async def connect(
        self, urls: list[str], rank_uuids: Sequence[str | None] | None = None, rank: int = 0
    ) -> None:
        """Every engine loads the files itself: only rank 0 of a group writes them."""
        await self.close()
        self.clients = [EngineClient(u) for u in urls] if rank == 0 else []
        logger.info("weight sync by files under %s to %d engine(s)", self.root, len(self.clients))

    async def send_bucket(self, bucket: Named, version: int, last: bool) -> None:
        """Collect `bucket`; the last one writes version `version` and has every engine load it."""
        self._pending += bucket
        if not last:
            return
        named, self._pending = self._pending, []
        folder = await asyncio.to_thread(save_weights, named, self.root / f"v{version:06d}")
        await asyncio.gather(
            *(
                c.update_weights_from_disk(str(folder), weight_version=version_to_engine(version))
                for c in self.clients
            )
        )
        for old in sorted(self.root.glob("v[0-9]*"))[:-KEEP_VERSIONS]:
            shutil.rmtree(old, ignore_errors=True)

    async def close(self) -> None:
        self._pending = []
        for c in self.clients:
            await c.close()
        self.clients = []
