"""The data plane's doorbell: producers ring after each write, a waiting consumer polls TransferQueue when
the rings say its rows may be there, and still polls on a slow timer when no ring comes."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from relax.dataplane import doorbell
from relax.utils.net import free_port


def rows(n: int) -> list[dict]:
    return [{"prompt_ids": [1], "response_ids": [2, 3], "group_id": i // 2, "length": 3} for i in range(n)]


async def _joined(bell: doorbell.Bell, listener: doorbell.Listener) -> None:
    """ZeroMQ drops what a publisher sends before the subscription reaches it: ring until heard."""
    for _ in range(200):
        bell.ring("warm-up", {"x": 1})
        listener.drain()
        if listener.rings("warm-up"):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the listener never heard the hub")


@contextlib.asynccontextmanager
async def _doorbell():
    """A hub, a bell and a listener that hears it."""
    hub = doorbell.DoorbellHub()
    bell, listener = doorbell.Bell(hub.writers), doorbell.Listener(hub.listeners)
    try:
        await _joined(bell, listener)
        yield hub, bell, listener
    finally:
        listener.close()
        bell.close()
        hub.close()


def test_listener_wakes_on_the_ring_that_completes_the_batch():
    async def run():
        async with _doorbell() as (_, bell, listener):
            # nothing rung: the wait ends at its timeout (the caller then polls anyway)
            started = time.monotonic()
            assert not await listener.wait("p", ["rows"], 4, 0, 0.2)
            assert time.monotonic() - started >= 0.19

            second_rung = asyncio.Event()

            async def producer():
                bell.ring("p", {"rows": 2})
                bell.ring("other", {"rows": 9})  # another partition counts for nothing here
                await asyncio.sleep(0.3)
                second_rung.set()
                bell.ring("p", {"rows": 2, "advantages": 4})

            task = asyncio.create_task(producer())
            # True: woken by a ring, not at the timeout; and only once the second ring (4 of 4 rows) was
            # sent, not at the first (2 of 4)
            assert await listener.wait("p", ["rows"], 4, 0, 60.0)
            assert second_rung.is_set()
            await task
            assert listener.rings("p") == 2 and listener.may_hold("p", ["rows", "advantages"], 4)
            # rings already counted do not end a later wait: the poll after them found nothing
            assert not await listener.wait("p", ["rows"], 4, listener.rings("p"), 0.1)
            # a task's taken rows, and a cleared partition's counts, are forgotten together
            listener.took("p", "adv", 4)
            assert listener.taken("p", "adv") == 4
            bell.ring("p", doorbell.CLEARED)
            await asyncio.sleep(0.2)
            listener.drain()
            assert listener.rings("p") == 0 and listener.taken("p", "adv") == 0
            assert not listener.may_hold("p", ["rows"], 1)

    asyncio.run(run())


def test_a_missed_ring_is_made_good_by_the_producers_next_one():
    """Rings carry the producer's running totals: a listener that joined after the first write (a
    restarted role) counts every row once the producer rings again."""

    async def run():
        async with _doorbell() as (hub, bell, early):
            bell.ring("p", {"rows": 3})
            assert await early.wait("p", ["rows"], 3, 0, 5.0)
            late = doorbell.Listener(hub.listeners)
            try:
                await _joined(bell, late)
                assert not late.may_hold("p", ["rows"], 1)  # it missed the first ring
                bell.ring("p", {"rows": 1})
                assert await late.wait("p", ["rows"], 4, 0, 5.0)
                assert await early.wait("p", ["rows"], 4, 1, 5.0)  # totals, not added twice
                assert not early.may_hold("p", ["rows"], 5)
            finally:
                late.close()

    asyncio.run(run())


def test_listener_keeps_counts_for_a_bounded_number_of_partitions():
    async def run():
        async with _doorbell() as (_, bell, listener):
            for step in range(doorbell.HEARD_PARTITIONS + 10):
                bell.ring(f"train_{step}", {"rows": 1})
            deadline = time.monotonic() + 5
            while (
                not listener.rings(f"train_{doorbell.HEARD_PARTITIONS + 9}") and time.monotonic() < deadline
            ):
                await asyncio.sleep(0.01)
                listener.drain()
            assert listener.rings("train_0") == 0  # the oldest were dropped
            assert listener.may_hold(f"train_{doorbell.HEARD_PARTITIONS + 9}", ["rows"], 1)

    asyncio.run(run())


def test_a_ring_without_a_listener_does_not_block():
    import threading

    hub = doorbell.DoorbellHub()
    bell = doorbell.Bell(hub.writers)
    rung = []

    def ring_all():
        for _ in range(10_000):
            bell.ring("p", {"rows": 1})
            rung.append(1)

    ringer = threading.Thread(target=ring_all, daemon=True)
    ringer.start()
    ringer.join(120)  # a hang guard only: a ring that blocks stays blocked
    assert len(rung) == 10_000 and not ringer.is_alive()
    bell.close()
    hub.close()


def test_forged_replayed_and_malformed_rings_are_dropped():
    """In a run rings are signed with a key derived from the run's token. A stranger on the hub's ports
    (ZeroMQ takes any connection) subscribes, captures a genuine ring and sends it again, rings with a
    guessed key, unsigned and malformed messages: none counts, none wakes or clears a wait, none raises."""
    import zmq

    key = doorbell.doorbell_key("the-run-token")

    async def run():
        hub = doorbell.DoorbellHub()
        bell, listener = doorbell.Bell(hub.writers, key=key), doorbell.Listener(hub.listeners, key=key)
        ctx = zmq.Context.instance()
        spy, stranger = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        spy.connect(hub.listeners)
        spy.setsockopt(zmq.SUBSCRIBE, b"")
        stranger.connect(hub.writers)
        try:
            await _joined(bell, listener)
            bell.ring("p", {"rows": 2})
            assert await listener.wait("p", ["rows"], 2, 0, 5.0)
            captured = spy.recv_multipart()
            while captured[0] != b"p":
                captured = spy.recv_multipart()
            heard = listener.rings("p")
            guess = doorbell.doorbell_key("a-guess")
            forged = [b'{"w": "x", "n": 7, "rows": {"rows": 1000}}', b'{"w": "x", "n": 8, "cleared": true}']
            bad = [
                *([b"p", body, doorbell._mac(guess, b"p", body)] for body in forged),  # a guessed key
                captured,  # a replay of the genuine ring
                captured[:2],  # the same, unsigned
                [b"p", b'{"w": "x", "n": 1, "rows": {"rows": 1000}}'],  # unsigned
                [b"p", b"not json", b"0" * doorbell.MAC_BYTES],
                [b"p"],
            ]
            for _ in range(500):  # until the stranger's connection is up: the spy hears its last message
                for frames in bad:
                    stranger.send_multipart(frames)
                await asyncio.sleep(0.01)
                if spy.poll(0) and any(f[-1:] == [b"p"] for f in _all(spy)):
                    break
            else:
                raise AssertionError("the stranger's messages never reached the hub")
            # the hub forwards in order: once this ring is heard, so was everything the stranger sent
            bell.ring("q", {"rows": 1})
            assert await listener.wait("q", ["rows"], 1, 0, 5.0)
            assert listener.rings("p") == heard and listener.may_hold("p", ["rows"], 2)  # not cleared
            assert not listener.may_hold("p", ["rows"], 3)
            assert listener.dropped >= len(bad)
        finally:
            for sock in (spy, stranger):
                sock.close(linger=0)
            for end in (bell, listener, hub):
                end.close()

    asyncio.run(run())

    # without a run token nothing is checked, but a malformed message is still dropped, not raised
    unsigned = doorbell.Listener(f"tcp://127.0.0.1:{free_port()}")
    unsigned._hear([b"p", b"not json"])
    unsigned._hear([b"p", b'{"w": "x", "n": 1, "rows": ["rows"]}'])
    assert unsigned.dropped == 2 and unsigned.rings("p") == 0
    unsigned.close()


def test_in_a_run_rings_are_signed_with_the_run_tokens_key():
    """Roles hold the run's token (set at their start-up): their bells sign with its key and their
    listeners hear them; a listener of another run drops them."""
    from relax.utils.auth import set_process_token

    async def run():
        set_process_token("the-run-token")
        try:
            async with _doorbell() as (hub, bell, listener):
                other = doorbell.Listener(hub.listeners, key=doorbell.doorbell_key("another-run"))
                try:
                    bell.ring("p", {"rows": 2})
                    assert await listener.wait("p", ["rows"], 2, 0, 5.0)
                    for _ in range(500):  # until its subscription reached the hub and a ring came
                        bell.ring("q", {"rows": 1})
                        other.drain()
                        if other.dropped:
                            break
                        await asyncio.sleep(0.01)
                    assert other.dropped and other.rings("q") == 0
                finally:
                    other.close()
        finally:
            set_process_token(None)

    asyncio.run(run())


def _all(sock) -> list[list[bytes]]:
    out = []
    while sock.poll(0):
        out.append(sock.recv_multipart())
    return out


@pytest.mark.slow
def test_tq_consumer_polls_when_rung_and_falls_back_to_a_slow_poll(ray_cluster, monkeypatch):
    """Over the real TransferQueue: a consumer waiting for 4 rows written in two writes polls once at the
    start and once after the second ring, and is woken by that ring, not by a timer (the fallback is set to
    30 s here). A write that does not ring is found by the fallback poll."""
    from relax.dataplane.transferqueue import TransferQueueDataPlane

    plane = TransferQueueDataPlane.create()
    polls: list[float] = []
    original = plane._call

    async def counting(name, *args, **kwargs):
        if name == "get_meta" and kwargs.get("mode") == "fetch":
            polls.append(time.monotonic())
        return await original(name, *args, **kwargs)

    monkeypatch.setattr(plane, "_call", counting)

    async def rung():
        monkeypatch.setattr(doorbell, "BELL_FALLBACK_S", 30.0)
        waiter = asyncio.create_task(plane.get("bell_p", ["reward"], "adv", 4, timeout_s=60))
        await asyncio.sleep(0.5)  # the waiter polled once and subscribed
        await plane.put_rows("bell_p", [{**r, "reward": 1.0} for r in rows(2)])
        await asyncio.sleep(0.3)
        assert not waiter.done()  # 2 of 4 rows: no poll, no rows
        written = time.monotonic()
        await plane.put_rows("bell_p", [{**r, "reward": 0.0, "group_id": 5} for r in rows(2)])
        got = await asyncio.wait_for(waiter, 10)  # the fallback poll would come only after 30 s
        assert len(got) == 4 and polls[-1] > written  # found by the poll after the second write's ring
        assert len(polls) == 2, polls

    async def silent():
        monkeypatch.setattr(doorbell, "BELL_FALLBACK_S", 0.2)
        polls.clear()
        waiter = asyncio.create_task(plane.get("bell_q", ["reward"], "adv", 2, timeout_s=30))
        await asyncio.sleep(0.3)
        monkeypatch.setattr(plane, "_ring", lambda *a, **k: None)
        await plane.put_rows("bell_q", [{**r, "reward": 1.0} for r in rows(2)])
        got = await asyncio.wait_for(waiter, 10)
        assert len(got) == 2
        assert 2 <= len(polls) <= 15, polls  # every ~0.2 s, not every few milliseconds

    try:
        asyncio.run(rung())
        asyncio.run(silent())
        asyncio.run(plane.clear("bell_p"))
        asyncio.run(plane.clear("bell_q"))
    finally:
        asyncio.run(plane.close())
