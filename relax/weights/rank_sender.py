"""Weight publishing from a sharded trainer: every rank gathers full tensors bucket by bucket; rank 0
broadcasts each bucket to the receivers on other GPUs as soon as it is gathered, and every rank hands it
by CUDA IPC to the receivers on its own GPU (colocated engines, ActorFwd).

Rank 0 sends bucket k while it gathers bucket k+2 (bucket k+1 is already gathered: one bucket is held
back to know which is the last, since the version travels with the last bucket only and a receiver
reports the new version once it holds all of it). Peak extra memory is therefore about three buckets,
plus the packed copy of the bucket being sent. Each rank keeps its `WeightSender` (built by
`relax.weights.sender.build_sender` from the run's settings, like the one-process trainer's: HTTP clients
and group) on a private event loop in a thread of its own, because the rank is a plain synchronous Ray
actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from relax.weights.sender import SenderSettings, WeightSender, build_sender, stream_buckets

logger = logging.getLogger(__name__)


class RankSender:
    """One training rank's side of a push: drives a `WeightSender` from the rank's synchronous code."""

    def __init__(self, settings: SenderSettings, device: torch.device | None = None) -> None:
        """`device`: the rank's device; a GPU is made current in the sending thread (a thread starts on
        cuda:0, which is another GPU when the rank sees all of them), a CPU one sends through gloo."""
        self.device = device
        self.settings = settings
        self.sender: WeightSender | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _submit(self, coro: Any) -> Future:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._serve, args=(self._loop,), name="weight-send", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Any) -> Any:
        return self._submit(coro).result()

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        loop.run_forever()

    def connect(self, urls: list[str], rank_uuids: Sequence[str | None] | None = None, rank: int = 0) -> None:
        """Rank 0 forms the group with the receivers on other GPUs; every rank takes those on its GPU."""
        if self.sender is None:
            self.sender = build_sender(self.settings, self.device)
        self._run(self.sender.connect(urls, rank_uuids, rank))

    def send_stream(self, named: Iterable[tuple[str, Tensor]], version: int, log: bool) -> dict[str, float]:
        """Walk `named` (collective gathers on every rank); send each bucket to this rank's receivers.
        `log`: this rank reports the push (rank 0).

        Bucket k is sent (by the sending thread) while this thread gathers bucket k+1, so the host time
        of the gathers and casts overlaps the receivers' loads; buckets still go out one at a time, in
        order (the version travels with the last)."""
        t0 = time.perf_counter()
        nbytes, count, buckets, waited = 0, 0, 0, 0.0
        connected = self.sender is not None and self.sender.connected
        sending: Future | None = None
        try:
            for bucket, last in stream_buckets(named, self.settings.bucket_bytes):
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                count += len(bucket)
                buckets += 1
                if connected:
                    waited += _wait(sending)
                    sending = self._submit(self.sender.send_bucket(bucket, version, last))
            waited += _wait(sending)
        except BaseException:
            if sending is not None and not sending.done():  # a failed gather: let the send end first
                with contextlib.suppress(Exception):
                    sending.result(timeout=60)
            raise
        seconds = time.perf_counter() - t0
        if log:
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
            "perf/weight_publish_wait_s": waited,  # of which waiting for sends (the rest: gathering)
            "tensors": float(count),
        }

    def close(self) -> None:
        if self.sender is not None:
            self._run(self.sender.close())
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)


def _wait(sending: Future | None) -> float:
    """Wait for the previous bucket's send (raising its error); returns the seconds waited."""
    if sending is None:
        return 0.0
    t0 = time.perf_counter()
    sending.result()
    return time.perf_counter() - t0
