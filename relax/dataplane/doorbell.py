"""Write notices for a polling data plane (TransferQueue): after every write a producer rings (the
partition, and how many rows it wrote of which fields); a consumer waiting in `get` polls the plane
when what it has heard says its rows may be there, instead of on a timer.

Why: TransferQueue's controller has no notifications (its blocking mode sleeps inside its single
request thread), so a waiting consumer polls it: several controller round trips a step, each costing
CPU on both sides, and a step's rows seen up to one poll interval late (docs/measurements.md). A ring is
one small ZeroMQ message; the consumer polls once per ring that could complete its batch.

Shape: one `DoorbellHub` per run, a ZeroMQ XSUB/XPUB proxy on a thread of the process that created the
plane (the driver); producers publish to it (`Bell`), consumers subscribe (`Listener`). Rings are a
hint, never the truth: a consumer still confirms with a poll, and polls anyway every
`BELL_FALLBACK_S` while it waits, so a ring lost (a role's first writes before its connection is up, a
restarted role that missed the rings of a step in flight) costs latency, not correctness.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict

import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

# A consumer that has heard nothing that could complete its batch still polls this often.
BELL_FALLBACK_S = 0.1
HEARD_PARTITIONS = 32  # partitions a listener keeps counts for (steps in flight, with margin)
HWM = 100_000  # messages queued per socket before ZeroMQ drops rings (a listener drains at each wait)
CLEARED = "cleared"  # the ring of `clear`: the partition's counts start again


class DoorbellHub:
    """Forwards every producer's rings to every listener (ZeroMQ XSUB -> XPUB, on a daemon thread).
    `writers` and `listeners` are the addresses producers and consumers connect to."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._ctx = zmq.Context()
        xsub, xpub = self._ctx.socket(zmq.XSUB), self._ctx.socket(zmq.XPUB)
        for sock in (xsub, xpub):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, HWM)
            sock.setsockopt(zmq.RCVHWM, HWM)
        self.writers = f"tcp://{host}:{xsub.bind_to_random_port(f'tcp://{host}')}"
        self.listeners = f"tcp://{host}:{xpub.bind_to_random_port(f'tcp://{host}')}"
        control = f"inproc://relax-doorbell-{uuid.uuid4().hex}"
        theirs = self._ctx.socket(zmq.PAIR)
        theirs.bind(control)
        self._control = self._ctx.socket(zmq.PAIR)
        self._control.connect(control)
        self._thread = threading.Thread(
            target=self._forward, args=(xsub, xpub, theirs), name="relax-doorbell", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _forward(xsub: zmq.Socket, xpub: zmq.Socket, control: zmq.Socket) -> None:
        try:
            zmq.proxy_steerable(xsub, xpub, None, control)
        except zmq.ZMQError as e:  # the context ended under it
            logger.debug("doorbell hub stopped: %s", e)
        finally:
            for sock in (xsub, xpub, control):
                sock.close(linger=0)

    def close(self) -> None:
        self._control.send(b"TERMINATE")
        self._thread.join(timeout=5)
        self._control.close(linger=0)
        self._ctx.term()


class Bell:
    """A producer's side. Each ring carries this producer's running totals for the partition, so a lost
    ring is made good by the next one. `ring` never blocks: a ring nobody hears, or one over the queue
    limit, is dropped (the listeners' fallback polls cover a producer's last ring)."""

    def __init__(self, address: str) -> None:
        self._sock = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.connect(address)
        self._id = uuid.uuid4().hex[:12]
        self._sent: OrderedDict[str, Counter[str]] = OrderedDict()
        self._lock = threading.Lock()  # ZeroMQ sockets are not thread-safe; writers may be on threads

    def ring(self, partition: str, fields: dict[str, int] | str) -> None:
        """`fields`: rows just written per field, or `CLEARED`."""
        with self._lock:
            if fields == CLEARED:
                self._sent.pop(partition, None)
                body: dict = {"w": self._id, CLEARED: True}
            else:
                sent = self._sent.setdefault(partition, Counter())
                sent.update(fields)
                self._sent.move_to_end(partition)
                while len(self._sent) > HEARD_PARTITIONS:
                    self._sent.popitem(last=False)
                body = {"w": self._id, "rows": sent}
            try:
                self._sock.send_multipart([partition.encode(), json.dumps(body).encode()], flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # full queue, closed context: a ring is only a hint
                logger.debug("ring for %s dropped: %s", partition, e)

    def close(self) -> None:
        self._sock.close(linger=0)


class Listener:
    """A consumer's side, for one event loop: per partition, each producer's running totals of rows per
    field, how many rings it heard, and how many rows each task of this loop took (a wait expects that
    many more)."""

    def __init__(self, address: str) -> None:
        self._sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, HWM)
        self._sock.connect(address)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._drain_sock = zmq.Socket.shadow(self._sock.underlying)  # non-blocking reads, no future
        # partition -> producer -> its running totals of rows per field
        self._rows: OrderedDict[str, dict[str, dict[str, int]]] = OrderedDict()
        self._rings: dict[str, int] = {}
        self._taken: dict[str, Counter[str]] = {}

    def _hear(self, frames: list[bytes]) -> None:
        partition, body = frames[0].decode(), json.loads(frames[1])
        if body.get(CLEARED):
            self._forget(partition)
            return
        self._heard(partition)[body["w"]] = body["rows"]
        self._rings[partition] = self._rings.get(partition, 0) + 1

    def _heard(self, partition: str) -> dict[str, dict[str, int]]:
        heard = self._rows.setdefault(partition, {})
        self._rows.move_to_end(partition)
        while len(self._rows) > HEARD_PARTITIONS:
            self._forget(next(iter(self._rows)))
        return heard

    def _forget(self, partition: str) -> None:
        self._rows.pop(partition, None)
        self._rings.pop(partition, None)
        self._taken.pop(partition, None)

    def drain(self) -> None:
        """Take every ring already queued."""
        while True:
            try:
                self._hear(self._drain_sock.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                return

    def rings(self, partition: str) -> int:
        """Rings heard for `partition` so far (call `drain` first)."""
        return self._rings.get(partition, 0)

    def took(self, partition: str, task: str, rows: int) -> None:
        """Task `task` of this loop took `rows` rows of `partition`."""
        self._heard(partition)
        self._taken.setdefault(partition, Counter())[task] += rows

    def taken(self, partition: str, task: str) -> int:
        return self._taken.get(partition, Counter())[task]

    def may_hold(self, partition: str, fields: list[str], rows: int) -> bool:
        """Whether the rings say `partition` may hold `rows` rows of every field in `fields`."""
        heard = self._rows.get(partition, {}).values()
        return all(sum(totals.get(f, 0) for totals in heard) >= rows for f in fields)

    async def wait(self, partition: str, fields: list[str], rows: int, seen: int, timeout_s: float) -> bool:
        """Wait until a ring for `partition` after the first `seen` says it may hold `rows` rows of
        `fields`; False when `timeout_s` passed first (poll anyway)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain()
            if self.rings(partition) > seen and self.may_hold(partition, fields, rows):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self._sock.poll(timeout=max(1, int(left * 1000)), flags=zmq.POLLIN)

    def close(self) -> None:
        self._sock.close(linger=0)
