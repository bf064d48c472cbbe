"""The data plane: one partition per training step, rows written by Rollout, columns added by other
producers (ActorFwd, Reference, Advantages), consumers tracked by task name.

`get` blocks until `batch_size` rows hold every requested column and were not yet handed to that task;
which rows it returns is the sampler's choice (`relax.dataplane.samplers`). `clear` drops a partition
once the Actor has trained on it. Column values are plain Python objects (lists of ints/floats, floats).

Implementations: `LocalDataPlane` (in process; the unit tests' plane and the body of the Ray actor),
`RayDataPlane` (one named Ray actor shared by every role) and `TransferQueueDataPlane`
(`relax.dataplane.transferqueue`, PyPI `transferqueue`). `create_data_plane` / `connect_data_plane`
pick one by `schedule.data_plane`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from relax.dataplane.samplers import get_sampler

logger = logging.getLogger(__name__)

# A `get` that has waited this long for its rows says so (INFO), and again every interval: a one-line status
# that tells a long step (a long-reasoning rollout can take many minutes) from a stalled producer or rows
# the sampler cannot serve.
STALL_WARN_S = 300.0
# fully_async: how often a stage role (ActorFwd, Reference, Advantages) polls a polling plane that has no
# doorbell (`relax.dataplane.doorbell`; TransferQueue started by Relax has one) while it waits for a
# step's rows. Its column is the last thing the Actor waits for, so the poll interval is on the step's
# critical path (docs/measurements.md).
STAGE_POLL_S = 0.01


@dataclass
class DataBatch:
    """Rows handed to one consumer: their indexes in the partition and the requested columns."""

    indexes: list[int]  # row ids within the partition, the order of every column list
    columns: dict[str, list[Any]]  # column name -> one value per row

    def __len__(self) -> int:
        return len(self.indexes)


class DataPlane(Protocol):
    async def put_rows(self, partition: str, rows: list[dict[str, Any]]) -> list[int]:
        """Append rows (column name -> value) to `partition`; returns their row ids."""

    async def put_columns(self, partition: str, indexes: list[int], columns: dict[str, list[Any]]) -> None:
        """Add columns to existing rows (one value per index)."""

    async def get(
        self,
        partition: str,
        columns: list[str],
        task: str,
        batch_size: int,
        *,
        sampler: str = "sequential",
        num_ranks: int = 1,
        timeout_s: float | None = None,
        poll_max_s: float | None = None,
    ) -> DataBatch:
        """Block until the sampler can hand `task` `batch_size` rows holding all `columns`; mark them
        consumed by `task`. Raises `TimeoutError` after `timeout_s`. `poll_max_s`: a plane that polls on
        a timer (TransferQueue without a doorbell) polls at least this often, for a consumer whose wait is
        on the critical path; event-driven planes, and TransferQueue woken by its doorbell, ignore it."""

    async def clear(self, partition: str) -> None:
        """Forget a partition (rows, columns, consumption)."""


class _Partition:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.consumed: dict[str, set[int]] = {}


class LocalDataPlane:
    """In-process data plane on asyncio: the whole contract, no transport."""

    def __init__(self) -> None:
        self.partitions: dict[str, _Partition] = {}
        self._changed: asyncio.Condition | None = None

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _part(self, name: str) -> _Partition:
        return self.partitions.setdefault(name, _Partition())

    async def _notify(self) -> None:
        async with self._cond():
            self._cond().notify_all()

    async def put_rows(self, partition: str, rows: list[dict[str, Any]]) -> list[int]:
        p = self._part(partition)
        first = len(p.rows)
        p.rows.extend(dict(r) for r in rows)
        await self._notify()
        return list(range(first, first + len(rows)))

    async def put_columns(self, partition: str, indexes: list[int], columns: dict[str, list[Any]]) -> None:
        p = self._part(partition)
        for name, values in columns.items():
            if len(values) != len(indexes):
                raise ValueError(f"column {name!r}: {len(values)} values for {len(indexes)} rows")
            for i, v in zip(indexes, values, strict=True):
                p.rows[i][name] = v
        await self._notify()

    def _try_take(
        self, partition: str, columns: list[str], task: str, batch_size: int, sampler: str, num_ranks: int
    ) -> DataBatch | None:
        p = self._part(partition)
        done = p.consumed.setdefault(task, set())
        ready = [
            i for i, r in enumerate(p.rows) if i not in done and all(c in r for c in columns)
        ]  # insertion order
        groups = {i: int(r.get("group_id", i)) for i, r in enumerate(p.rows)}
        lengths = {i: int(r.get("length", 1)) for i, r in enumerate(p.rows)}
        chosen = get_sampler(sampler)(ready, batch_size, groups, lengths, num_ranks)
        if not chosen:
            return None
        done.update(chosen)
        return DataBatch(chosen, {c: [p.rows[i][c] for i in chosen] for c in columns})

    async def get(
        self,
        partition: str,
        columns: list[str],
        task: str,
        batch_size: int,
        *,
        sampler: str = "sequential",
        num_ranks: int = 1,
        timeout_s: float | None = None,
        poll_max_s: float | None = None,  # woken by every write: nothing to poll
    ) -> DataBatch:
        async def wait() -> DataBatch:
            started = warned = time.monotonic()
            async with self._cond():
                while True:
                    got = self._try_take(partition, columns, task, batch_size, sampler, num_ranks)
                    if got is not None:
                        return got
                    if time.monotonic() - warned >= STALL_WARN_S:
                        warned = time.monotonic()
                        logger.info(
                            "data plane: %r still waiting after %.0f s for %d rows with %s of %r (sampler %s): %s",
                            task, warned - started, batch_size, columns, partition, sampler,
                            self.status(partition),
                        )  # fmt: skip
                    with contextlib.suppress(asyncio.TimeoutError):  # woken by a write, or to warn again
                        await asyncio.wait_for(self._cond().wait(), warned + STALL_WARN_S - time.monotonic())

        try:
            return await asyncio.wait_for(wait(), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"data plane: {task!r} waited {timeout_s}s for {batch_size} rows with {columns} in "
                f"{partition!r} ({self.status(partition)})"
            ) from None

    def status(self, partition: str) -> dict[str, Any]:
        """Rows and per-column fill of a partition (for error messages and tests)."""
        p = self.partitions.get(partition)
        if p is None:
            return {"rows": 0}
        cols: dict[str, int] = {}
        for r in p.rows:
            for c in r:
                cols[c] = cols.get(c, 0) + 1
        return {"rows": len(p.rows), "columns": cols, "consumed": {t: len(s) for t, s in p.consumed.items()}}

    async def clear(self, partition: str) -> None:
        self.partitions.pop(partition, None)

    async def close(self) -> None:
        self.partitions.clear()


class RowWriter:
    """`put_rows` for many concurrent writers of few rows (the Rollout writes each prompt group as it
    finishes): while one put to a partition is in flight, the rows that arrive for it wait and go out
    together in the next put. No timer: a lone write goes out at once, and under load the puts grow
    instead of queueing (each put costs the plane's round trips and its per-call work, which on 2 CPU
    cores competes with the trainer). Each `write` returns when its own rows are in the plane, or raises
    the error of the put that carried them.

    `writes_per_put` > 1: a put also waits until that many writes are waiting for the partition, or until
    its last write (the `writes_per_partition`-th) arrived: when every reader of the partition takes a
    batch of that size, smaller puts only cost round trips."""

    def __init__(
        self, plane: DataPlane, writes_per_put: int = 1, writes_per_partition: int | None = None
    ) -> None:
        if writes_per_put > 1 and writes_per_partition is None:
            raise ValueError("RowWriter: writes_per_put > 1 needs writes_per_partition (to flush the last)")
        self.plane = plane
        self.writes_per_put, self.writes_per_partition = writes_per_put, writes_per_partition
        self._waiting: dict[str, list[tuple[list[dict[str, Any]], asyncio.Future]]] = {}
        self._written: dict[str, int] = {}  # partition -> writes received (with writes_per_put > 1)
        self._drains: dict[str, asyncio.Task] = {}
        self.puts = 0  # puts made (for tests and benchmarks)

    async def write(self, partition: str, rows: list[dict[str, Any]]) -> None:
        done = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(partition, []).append((rows, done))
        if self.writes_per_put > 1:
            self._written[partition] = self._written.get(partition, 0) + 1
        if partition not in self._drains and self._ready(partition):
            # a task of its own: a cancelled writer does not stop it
            self._drains[partition] = asyncio.create_task(self._drain(partition))
        await asyncio.shield(done)

    def _ready(self, partition: str) -> bool:
        waiting = len(self._waiting.get(partition, ()))
        if self.writes_per_put <= 1 or waiting >= self.writes_per_put:
            return waiting > 0
        return waiting > 0 and self._written.get(partition, 0) >= (self.writes_per_partition or 0)

    async def _drain(self, partition: str) -> None:
        try:
            while self._ready(partition) and (batch := self._waiting.pop(partition, None)):
                self.puts += 1
                try:
                    await self.plane.put_rows(partition, [r for rows, _ in batch for r in rows])
                except Exception as e:  # noqa: BLE001 - handed to every writer whose rows it carried
                    for _, done in batch:
                        if not done.done():
                            done.set_exception(e)
                else:
                    for _, done in batch:
                        if not done.done():
                            done.set_result(None)
        finally:
            del self._drains[partition]
            if partition not in self._waiting and self._written.get(partition, 0) >= (
                self.writes_per_partition or 0
            ):
                self._written.pop(partition, None)


ACTOR_NAME, NAMESPACE = "relax_data_plane", "relax"


class _PlaneActor(LocalDataPlane):
    """The plane's Ray actor: its log lines (a `get` still waiting, with the partition's status) go where
    the roles' go (`setup_logging`); unconfigured, Python drops INFO."""

    def __init__(self) -> None:
        from relax.utils.logging import setup_logging

        setup_logging()
        super().__init__()


class RayDataPlane:
    """A `LocalDataPlane` inside one named async Ray actor; every role holds this thin client."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    @classmethod
    def create(cls) -> RayDataPlane:
        import ray

        remote = ray.remote(num_cpus=0, max_concurrency=1000)(_PlaneActor)
        actor = remote.options(name=ACTOR_NAME, namespace=NAMESPACE, get_if_exists=True).remote()
        return cls(actor)

    @classmethod
    def connect(cls) -> RayDataPlane:
        import ray

        return cls(ray.get_actor(ACTOR_NAME, namespace=NAMESPACE))

    async def put_rows(self, partition: str, rows: list[dict[str, Any]]) -> list[int]:
        return await self.actor.put_rows.remote(partition, rows)

    async def put_columns(self, partition: str, indexes: list[int], columns: dict[str, list[Any]]) -> None:
        await self.actor.put_columns.remote(partition, indexes, columns)

    async def get(
        self, partition: str, columns: list[str], task: str, batch_size: int, **kw: Any
    ) -> DataBatch:
        return await self.actor.get.remote(partition, columns, task, batch_size, **kw)

    async def clear(self, partition: str) -> None:
        await self.actor.clear.remote(partition)

    async def close(self) -> None:
        import ray

        ray.kill(self.actor)


class PlaneClient:
    """Mixin for roles: `self.plane` connects to the run's data plane on first use, not in the constructor,
    so the driver can start the plane while the roles' replicas start (`Deployment.start`).
    A plane passed to the constructor (tests) is used as is."""

    _plane: DataPlane | None = None
    _plane_kind: str = "transferqueue"

    def _use_plane(self, plane: DataPlane | None, kind: str) -> None:
        """The constructor's part: `plane` (None: connect to the run's plane of `kind` on first use).
        The client's modules are imported now, inside the constructor, so that they are among the
        start-up objects a role replica freezes (relax/utils/gc_freeze.py). Imported at the first write
        instead, TransferQueue's (tensordict, torch._dynamo) stayed with the collector, and every full
        collection of a step walked them on the role's event loop (docs/measurements.md)."""
        self._plane, self._plane_kind = plane, kind
        if plane is None:
            import_data_plane(kind)

    @property
    def plane(self) -> DataPlane:
        if self._plane is None:
            self._plane = connect_data_plane(self._plane_kind)
        return self._plane

    @plane.setter
    def plane(self, plane: DataPlane | None) -> None:
        self._plane = plane


def create_data_plane(kind: str, host: str | None = None, actor_options: dict | None = None) -> DataPlane:
    """Called once by the Controller before the roles start: the shared plane of kind `kind`; servers it
    starts in this process (TransferQueue's doorbell hub) listen on `host` (default: Ray's node IP);
    `actor_options`: Ray options of each TransferQueue actor (CPUs and placement, `resources.*`)."""
    if kind == "transferqueue":
        from relax.dataplane.transferqueue import TransferQueueDataPlane

        return TransferQueueDataPlane.create(host=host, actor_options=actor_options)
    if kind == "ray":
        return RayDataPlane.create()
    raise ValueError(f"unknown schedule.data_plane {kind!r}; valid: ray, transferqueue")


def import_data_plane(kind: str) -> None:
    """Import the client of the plane of kind `kind` (see `PlaneClient._use_plane`)."""
    if kind == "transferqueue":
        import relax.dataplane.transferqueue  # noqa: F401


def connect_data_plane(kind: str) -> DataPlane:
    """Called by each role: a client of the plane the Controller created."""
    if kind == "transferqueue":
        from relax.dataplane.transferqueue import TransferQueueDataPlane

        return TransferQueueDataPlane.connect()
    if kind == "ray":
        return RayDataPlane.connect()
    raise ValueError(f"unknown schedule.data_plane {kind!r}; valid: ray, transferqueue")
