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

Authentication: the hub's ports take any connection (ZeroMQ has none by default), so in a run every ring
is signed: HMAC-SHA256 over the partition and the body with a key derived from the run's token
(`doorbell_key`), and numbered per producer. A listener drops a ring with a wrong or missing signature,
one whose number it has seen (a replay), and anything malformed, before it counts: a stranger cannot wake
consumers (each false wake-up costs a TransferQueue poll), clear their counts or stop a wait with a
message that does not parse. Rings are not encrypted: a stranger who subscribes learns partition and
field names and row counts (the run's progress), which open nothing; no row data travels here.
Without a run token (a plane used outside a run) rings are neither signed nor checked.
"""

from __future__ import annotations

import hashlib
import hmac
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
MAC_BYTES = 16  # of the HMAC-SHA256 on each ring
KNOWN_WRITERS = 4096  # producers whose last ring number a listener keeps (replays of older ones pass)
_KEYS: dict[str, bytes] = {}  # run token -> its doorbell key


def doorbell_key(token: str | None = None) -> bytes | None:
    """The rings' signing key of the run whose token is `token` (default: this process's; None: no
    token, rings unsigned). Derived, so the run's token itself never signs anything outside HTTP."""
    from relax.utils.auth import process_token

    token = token or process_token()
    if not token:
        return None
    if token not in _KEYS:
        _KEYS[token] = hmac.new(token.encode(), b"relax-doorbell", hashlib.sha256).digest()
    return _KEYS[token]


def _mac(key: bytes, partition: bytes, body: bytes) -> bytes:
    return hmac.new(key, len(partition).to_bytes(4, "big") + partition + body, hashlib.sha256).digest()[
        :MAC_BYTES
    ]


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

    def __init__(self, address: str, key: bytes | None = None) -> None:
        """`key`: signs the rings (default: `doorbell_key()` of this process's run token, read per ring,
        so a bell made before the token is known signs once it is)."""
        self._sock = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.connect(address)
        self._key = key
        self._id = uuid.uuid4().hex[:12]
        self._n = 0  # the number of the last ring: listeners drop one they have seen (a replay)
        self._sent: OrderedDict[str, Counter[str]] = OrderedDict()
        self._lock = threading.Lock()  # ZeroMQ sockets are not thread-safe; writers may be on threads

    def ring(self, partition: str, fields: dict[str, int] | str) -> None:
        """`fields`: rows just written per field, or `CLEARED`."""
        with self._lock:
            self._n += 1
            if fields == CLEARED:
                self._sent.pop(partition, None)
                body: dict = {"w": self._id, "n": self._n, CLEARED: True}
            else:
                sent = self._sent.setdefault(partition, Counter())
                sent.update(fields)
                self._sent.move_to_end(partition)
                while len(self._sent) > HEARD_PARTITIONS:
                    self._sent.popitem(last=False)
                body = {"w": self._id, "n": self._n, "rows": sent}
            frames = [partition.encode(), json.dumps(body).encode()]
            if (key := self._key or doorbell_key()) is not None:
                frames.append(_mac(key, *frames))
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:  # full queue, closed context: a ring is only a hint
                logger.debug("ring for %s dropped: %s", partition, e)

    def close(self) -> None:
        self._sock.close(linger=0)


class Listener:
    """A consumer's side, for one event loop: per partition, each producer's running totals of rows per
    field, how many rings it heard, and how many rows each task of this loop took (a wait expects that
    many more)."""

    def __init__(self, address: str, key: bytes | None = None) -> None:
        """`key`: rings must be signed with it (default: `doorbell_key()` of this process's run token,
        read per ring; None: every well-formed ring counts)."""
        self._key = key
        self._last: OrderedDict[str, int] = OrderedDict()  # producer -> number of its last ring heard
        self.dropped = 0  # rings refused: forged, replayed or malformed
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
        ring = self._check(frames)
        if ring is None:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10_000 == 0:  # a stranger could flood the log otherwise
                logger.warning(
                    "doorbell: %d ring(s) dropped (unsigned, forged, replayed or malformed)", self.dropped
                )
            return
        partition, writer, rows = ring
        if rows is None:
            self._forget(partition)
            return
        self._heard(partition)[writer] = rows
        self._rings[partition] = self._rings.get(partition, 0) + 1

    def _check(self, frames: list[bytes]) -> tuple[str, str, dict[str, int] | None] | None:
        """(partition, producer, its totals or None for `CLEARED`) of a genuine, new ring; else None."""
        key = self._key or doorbell_key()
        if key is not None and (
            len(frames) != 3 or not hmac.compare_digest(frames[2], _mac(key, *frames[:2]))
        ):
            return None
        try:
            partition, body = frames[0].decode(), json.loads(frames[1])
            writer, n = str(body["w"]), int(body["n"])
            rows = None if body.get(CLEARED) else {str(f): int(c) for f, c in body["rows"].items()}
        except (IndexError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if n <= self._last.get(writer, 0):  # a replay (a producer numbers its rings 1, 2, ...)
            return None
        self._last[writer] = n
        self._last.move_to_end(writer)
        while len(self._last) > KNOWN_WRITERS:
            self._last.popitem(last=False)
        return partition, writer, rows

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
