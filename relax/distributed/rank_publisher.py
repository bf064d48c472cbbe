"""Weight publishing from a sharded trainer: every rank gathers full tensors bucket by bucket, rank 0
broadcasts each bucket to the engines over the weight-sync group as soon as it is gathered.

Peak extra memory is about two buckets (the one being sent and the next, gathered to know which bucket
is the last: the version travels with the last bucket only, so an engine reports the new version once it
holds all of it). Rank 0 keeps its `WeightPublisher` (HTTP clients + group) on a private event loop,
because the rank is a plain synchronous Ray actor.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from torch import Tensor

from relax.distributed import weight_sync
from relax.distributed.weight_publisher import WeightPublisher

logger = logging.getLogger(__name__)

Named = list[tuple[str, Tensor]]


def stream_buckets(named: Iterable[tuple[str, Tensor]], bucket_bytes: int) -> Iterator[tuple[Named, bool]]:
    """(bucket, is_last) over consecutive buckets of at most `bucket_bytes` (a bigger tensor goes alone)."""
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


class RankPublisher:
    def __init__(self, bucket_bytes: int, backend: str = "auto") -> None:
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.publisher: WeightPublisher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _run(self, coro: Any) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="weight-publish", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def connect(self, urls: list[str]) -> None:
        """Rank 0: form the weight-sync group with the engines at `urls`."""
        self.publisher = self.publisher or WeightPublisher(self.bucket_bytes, backend=self.backend)
        self._run(self.publisher.connect(urls))

    def publish(self, named: Iterable[tuple[str, Tensor]], version: int, sender: bool) -> dict[str, float]:
        """Walk `named` (collective gathers on every rank); the sender pushes each bucket to the engines."""
        t0 = time.perf_counter()
        nbytes, count, buckets = 0, 0, 0
        connected = sender and self.publisher is not None and self.publisher.group is not None
        for bucket, last in stream_buckets(named, self.bucket_bytes):
            nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            count += len(bucket)
            buckets += 1
            if connected:
                self._run(_push_bucket(self.publisher, bucket, version, last))
        seconds = time.perf_counter() - t0
        if sender:
            logger.info(
                "weights v%d: %d tensors, %.1f MB in %d buckets, %.3fs",
                version,
                count,
                nbytes / 1e6,
                buckets,
                seconds,
            )
        return {
            "perf/weight_sync_bytes": float(nbytes),
            "perf/weight_publish_s": seconds,
            "tensors": float(count),
        }

    def close(self) -> None:
        if self.publisher is not None:
            self._run(self.publisher.close())
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)


async def _push_bucket(pub: WeightPublisher, bucket: Named, version: int, last: bool) -> None:
    group, clients = pub.group, pub.clients
    names = [n for n, _ in bucket]
    dtypes = [weight_sync.dtype_name(t.dtype) for _, t in bucket]
    shapes = [list(t.shape) for _, t in bucket]
    calls = [
        asyncio.create_task(
            c.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                group.name,
                weight_version=str(version) if last else None,
                flush_cache=last,
            )
        )
        for c in clients
    ]
    send = asyncio.create_task(asyncio.to_thread(group.broadcast, [t for _, t in bucket]))
    await weight_sync._all_or_first_error([send, *calls])  # noqa: SLF001 - the module's own failure policy
