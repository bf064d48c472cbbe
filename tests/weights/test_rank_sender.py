"""`RankSender.send_stream`: a bucket is sent while the next ones are gathered, in order, with the
version on the last bucket only; a failed send stops the push with its error."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from relax.weights.rank_sender import RankSender
from relax.weights.sender import SenderSettings

SEND_S = 0.05


class FakeSender:
    """Stands in for a `WeightSender`: each send takes SEND_S and records when it ran."""

    connected = True

    def __init__(self, fail_at: int | None = None) -> None:
        self.sends: list[tuple[list[str], bool, float, float]] = []  # names, last, start, end
        self.fail_at = fail_at
        self.active = 0
        self.max_active = 0

    async def send_bucket(self, bucket, version: int, last: bool) -> None:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        start = time.perf_counter()
        await asyncio.sleep(SEND_S)
        self.active -= 1
        if self.fail_at is not None and len(self.sends) == self.fail_at:
            raise RuntimeError("engine at 127.0.0.1:1 did not answer")
        self.sends.append(([n for n, _ in bucket], last, start, time.perf_counter()))

    async def close(self) -> None:
        pass


def gathered(n: int, log: dict[str, float]):
    """n one-element tensors of 4 bytes (a bucket of 8 bytes holds two); logs when each was gathered."""
    for i in range(n):
        time.sleep(SEND_S / 4)  # the host work of a gather
        log[f"w{i}"] = time.perf_counter()
        assert threading.current_thread() is threading.main_thread()
        yield f"w{i}", torch.zeros(1)


def rank_sender(sender: FakeSender) -> RankSender:
    pub = RankSender(SenderSettings(bucket_bytes=8))
    pub.sender = sender
    return pub


def test_buckets_go_out_in_order_while_the_next_ones_are_gathered():
    sender, log = FakeSender(), {}
    pub = rank_sender(sender)
    try:
        stats = pub.send_stream(gathered(10, log), version=3, log=True)
    finally:
        pub.close()
    assert [names for names, *_ in sender.sends] == [[f"w{i}", f"w{i + 1}"] for i in range(0, 10, 2)]
    assert [last for _, last, *_ in sender.sends] == [False] * 4 + [True]
    assert sender.max_active == 1  # one send at a time
    # bucket k+2 was completed while bucket k was being sent (its first tensor came before: it is what
    # told the stream that bucket k+1 was full)
    for k, (_, _, start, end) in enumerate(sender.sends[:3]):
        assert start < log[f"w{2 * (k + 2) + 1}"] < end
    assert stats["tensors"] == 10 and stats["perf/weight_sync_bytes"] == 40
    assert 0 < stats["perf/weight_publish_wait_s"] < stats["perf/weight_publish_s"]


def test_a_failed_send_stops_the_push_with_its_error():
    sender, log = FakeSender(fail_at=1), {}
    pub = rank_sender(sender)
    try:
        with pytest.raises(RuntimeError, match="did not answer"):
            pub.send_stream(gathered(10, log), version=3, log=True)
    finally:
        pub.close()
    assert len(sender.sends) == 1 and len(log) < 10  # nothing was sent or gathered after the failure
