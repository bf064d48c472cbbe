"""The data plane on TransferQueue (PyPI `transferqueue`): its controller tracks which fields of which
sample exist and which task consumed it, its storage units hold the values, and its client moves them.

Mapping: a partition is a TQ partition; a row is a TQ sample (its global index is the row id). The
Rollout's columns (`ROLLOUT_COLUMNS`, written together by `put_rows` and read together) travel packed as
one TQ field, `rows`, holding each row's dict; every column added later (`put_columns`: log-probs,
advantages, ...) is a TQ field of its own, so readiness per column still comes from TQ. One field
instead of nine per row: TQ serialises and tracks values per field and sample, so the packed field
costs a fraction of nine (docs/measurements.md).
`get` polls the controller in polling mode (TQ's blocking mode sleeps inside the
controller's single request thread, stalling every other client) and hands the choice of rows to
`RelaxTQSampler`, which runs our samplers with the group id and length kept as TQ custom metadata.
Writers ring a doorbell after each write (`relax.dataplane.doorbell`, its addresses kept in TQ's
config), so a waiting consumer polls when the rows may be there rather than on a timer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
import weakref
from collections import OrderedDict
from typing import Any

import msgspec

from relax.data.columns import ROLLOUT_COLUMNS
from relax.dataplane import doorbell
from relax.dataplane import plane as dp
from relax.dataplane.plane import DataBatch
from relax.dataplane.samplers import get_sampler

logger = logging.getLogger(__name__)

ROWS_FIELD = "rows"  # the TQ field holding `put_rows`' columns, one dict per row
ROW_COLUMNS = frozenset(ROLLOUT_COLUMNS)
POLL_S = 0.02  # first poll interval; doubles up to POLL_MAX_S
# A consumer that waits ahead (the Actor takes step k+1's rows while step k trains; the stage roles wait
# for their inputs) learns that the rows are there at most this late (docs/measurements.md), for at most
# 20 controller round trips a second per waiting consumer.
POLL_MAX_S = 0.05
TAKEN_PARTITIONS = 4  # partitions whose last taken rows' metadata `put_columns` may reuse
DOORBELL_KEY = "relax_doorbell"  # TQ config entry with the doorbell hub's addresses


def _sampler_base() -> type:
    from transfer_queue import BaseSampler

    return BaseSampler


class RelaxTQSampler(_sampler_base()):
    """TransferQueue sampler that runs `relax.dataplane.samplers` (chosen per call by
    `sampling_config={"sampler": name, "num_ranks": k}`); group ids and lengths come from custom meta.

    A row is served only once its custom meta has arrived. TQ's `put` stores the values (the storage
    unit then marks the row ready in the controller) and only afterwards sends the row's custom meta, so
    a consumer polling in between saw ready rows without a group id. `whole_groups` took each of them for
    a group of its own, handed out part of a real group, and the group's remaining rows could then never
    complete a whole-group batch: hybrid's Actor waited forever for its last sub-batch.
    """

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        *args: Any,
        partition: Any = None,
        sampler: str = "sequential",
        num_ranks: int = 1,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        ready = list(ready_indexes)
        groups: dict[int, int] = {}
        lengths: dict[int, int] = {}
        if partition is not None:
            meta = partition.get_custom_meta(ready)
            ready = [i for i in ready if i in meta]  # values written, custom meta not yet: wait
            groups, lengths = _group_ids(meta), {i: int(m.get("length") or 1) for i, m in meta.items()}
            if sampler == "whole_groups":  # a group's other rows may not be ready yet
                groups = _group_ids(partition.get_custom_meta(sorted(partition.global_indexes)))
        chosen = get_sampler(sampler)(ready, batch_size, groups, lengths, num_ranks)
        return chosen, list(chosen)


def _group_ids(meta: dict[int, dict]) -> dict[int, int]:
    """Row -> group id from TQ custom meta; a row written without one is a group of its own."""
    return {i: i if m.get("group_id") is None else int(m["group_id"]) for i, m in meta.items()}


# Values cross TransferQueue as msgpack bytes, one blob per row and field. Handed plain lists, TQ's own
# decoder walks every element of every list on each get and each storage put (thousands of Python calls
# a step; docs/measurements.md); bytes are one object to it.
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()


def _encode(column: str, values: list[Any]) -> list[bytes]:
    try:
        return [_ENCODER.encode(v) for v in values]
    except TypeError as e:
        raise TypeError(
            f"data plane: column {column!r} holds a value msgpack cannot encode ({e}); columns take plain "
            "Python values (numbers, strings, lists and dicts of them): convert tensors with .tolist() "
            "(relax.data.rows.tensor_column)"
        ) from None


def _to_values(x: Any, n: int) -> list[Any]:
    """One TQ field of `n` samples, as written (see `_encode`)."""
    rows = x.tolist() if hasattr(x, "tolist") else list(x)
    if len(rows) != n:
        raise RuntimeError(f"transferqueue returned {len(rows)} values for {n} samples")
    return [_DECODER.decode(v) for v in rows]


def _tensordict(columns: dict[str, list[Any]], n: int) -> Any:
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData, NonTensorStack

    return TensorDict(
        {k: NonTensorStack(*[NonTensorData(v) for v in _encode(k, vals)]) for k, vals in columns.items()},
        batch_size=n,
    )


class TransferQueueDataPlane:
    """`DataPlane` over TransferQueue's controller, storage units and client."""

    def __init__(self, client: Any) -> None:
        self.client = client  # TQ's synchronous client: `clear`, `close`, and where no config is known
        self._conf: Any = None  # the running TQ's config, for the clients below
        # One asynchronous TQ client per event loop (a role has one): its calls run on the caller's
        # loop instead of going through a worker thread into the synchronous client's own loop thread,
        # two thread hand-offs per call that, in a process whose other threads hold the interpreter
        # lock (the Rollout's HTTP traffic, a forward pass), took up to twice the call's own time.
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
        # The metadata of the last rows this process took, per partition: a stage role writes its column
        # for exactly those rows, so `put_columns` selects them here instead of asking the controller
        # for the partition's metadata first (one round trip less a write).
        self._taken: OrderedDict[str, Any] = OrderedDict()
        self._hub: doorbell.DoorbellHub | None = None  # the run's doorbell, owned by the creating process
        self._bell: doorbell.Bell | None = None
        self._listeners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, doorbell.Listener] = (
            weakref.WeakKeyDictionary()
        )
        self._actors: Any = None  # `tq_start.TQActors` this process started (`create`), stopped by `close`

    def _doorbell(self, kind: str) -> str | None:
        """The hub's address for `kind` ("writers" or "listeners"), None for a plane without one."""
        bell = None if self._conf is None else self._conf.get(DOORBELL_KEY)
        return None if bell is None else bell.get(kind)

    def _ring(self, partition: str, fields: dict[str, int] | str) -> None:
        if self._bell is not None:
            self._bell.ring(partition, fields)

    def _listener(self) -> doorbell.Listener | None:
        """The running loop's doorbell listener (made on first use), None without a doorbell."""
        address = self._doorbell("listeners")
        if address is None:
            return None
        loop = asyncio.get_running_loop()
        listener = self._listeners.get(loop)
        if listener is None:
            listener = self._listeners[loop] = doorbell.Listener(address)
        return listener

    def _async_client(self) -> Any:
        """The running loop's asynchronous client (made on first use), or None without a config."""
        if self._conf is None:
            return None
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            from transfer_queue.client import AsyncTransferQueueClient

            backend = self._conf.backend.storage_backend
            client = AsyncTransferQueueClient(
                f"relax_{os.getpid()}_{uuid.uuid4().hex[:8]}", self._conf.controller.zmq_info
            )
            client.initialize_storage_manager(manager_type=backend, config=self._conf.backend[backend])
            self._clients[loop] = client
        return client

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """TQ client method `name` (`get_meta`, `put`, `get_data`, `clear_partition`) on this loop's
        asynchronous client."""
        client = self._async_client()
        if client is None:
            return await asyncio.to_thread(getattr(self.client, name), *args, **kwargs)
        return await getattr(client, f"async_{name}")(*args, **kwargs)

    @classmethod
    def create(
        cls,
        num_storage_units: int = 1,
        host: str | None = None,
        actor_options: dict[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> TransferQueueDataPlane:
        """Start TQ's controller and storage units (once per run; `relax.dataplane.tq_start`: Ray's
        ordinary scheduling with `actor_options`, the Ray options of each actor, default one CPU each as
        TQ asks) with `RelaxTQSampler`; attach instead when a TQ controller already runs."""
        import ray
        from transfer_queue.client import TransferQueueClient

        from relax.dataplane.tq_start import CONTROLLER_NAME, NAMESPACE, START_TIMEOUT_S, start_tq

        try:
            ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
            return cls.connect()  # another run (or an earlier create) started it
        except ValueError:
            pass
        hub = doorbell.DoorbellHub(host or ray.util.get_node_ip_address())
        overrides = {
            "controller": {"polling_mode": True},
            "backend": {"SimpleStorage": {"num_data_storage_units": num_storage_units}},
            DOORBELL_KEY: {"writers": hub.writers, "listeners": hub.listeners},
        }
        options = {"num_cpus": 1.0, **(actor_options or {})}
        try:
            actors = start_tq(overrides, RelaxTQSampler(), options, timeout_s or START_TIMEOUT_S)
        except BaseException:
            hub.close()
            raise
        conf = actors.conf
        client = TransferQueueClient(f"TransferQueueClient_{os.getpid()}", conf.controller.zmq_info)
        client.initialize_storage_manager(manager_type="SimpleStorage", config=conf.backend.SimpleStorage)
        plane = cls(client)
        plane._conf, plane._hub, plane._actors = conf, hub, actors
        plane._bell = doorbell.Bell(hub.writers)  # connected now: subscriptions reach it before a write
        return plane

    @classmethod
    def connect(cls) -> TransferQueueDataPlane:
        import ray
        import transfer_queue as tq

        tq.init()  # attaches to the running controller
        controller = ray.get_actor("TransferQueueController", namespace="transfer_queue")
        return cls._with_conf(tq.get_client(), controller)

    @classmethod
    def _with_conf(cls, client: Any, controller: Any) -> TransferQueueDataPlane:
        import ray

        from relax.dataplane.tq_start import START_TIMEOUT_S

        plane = cls(client)
        plane._conf = ray.get(controller.get_config.remote(), timeout=START_TIMEOUT_S)
        address = plane._doorbell("writers")
        if address is not None:  # connected now, so the subscriptions reach it before the first write
            plane._bell = doorbell.Bell(address)
        return plane

    async def put_rows(self, partition: str, rows: list[dict[str, Any]]) -> list[int]:
        extra = sorted({k for r in rows for k in r} - ROW_COLUMNS)
        if extra:
            raise ValueError(
                f"data plane: row columns {extra} are not Rollout columns; add them to "
                "relax.data.columns.ROLLOUT_COLUMNS, or write them with put_columns"
            )

        if not rows:
            return []
        meta = await self._call(
            "get_meta", data_fields=[ROWS_FIELD], batch_size=len(rows), partition_id=partition, mode="insert"
        )
        meta.update_custom_meta([{"group_id": r.get("group_id"), "length": r.get("length", 1)} for r in rows])
        await self._call("put", _tensordict({ROWS_FIELD: rows}, len(rows)), metadata=meta)
        self._ring(partition, {ROWS_FIELD: len(rows)})
        return list(meta.global_indexes)

    async def put_columns(self, partition: str, indexes: list[int], columns: dict[str, list[Any]]) -> None:
        clash = sorted(set(columns) & ROW_COLUMNS)
        if clash:
            raise ValueError(f"data plane: {clash} are Rollout columns, written only with put_rows")

        meta = self._taken.get(partition)
        if meta is None or not set(indexes) <= set(meta.global_indexes):
            meta = await self._call(
                "get_meta", data_fields=[], batch_size=1, partition_id=partition, mode="force_fetch"
            )
        pos = {g: k for k, g in enumerate(meta.global_indexes)}
        missing = [i for i in indexes if i not in pos]
        if missing:
            raise KeyError(f"rows {missing} are not in partition {partition!r}")
        if list(indexes) == list(meta.global_indexes):  # the rows just taken, in order (a stage role's
            sub = meta  # write): TQ's `select_samples` deep-copies each row's metadata
        else:
            sub = meta.select_samples([pos[i] for i in indexes])
        await self._put_values(_tensordict(columns, len(indexes)), sub)
        self._ring(partition, dict.fromkeys(columns, len(indexes)))

    async def _put_values(self, data: Any, meta: Any) -> None:
        """Write `data` into rows that exist. TQ's `put` also sends every row's custom meta to the
        controller, even unchanged: here it is the group ids and lengths `put_rows` set, so that is one
        controller round trip a write for nothing (docs/measurements.md), and a write that raced the
        partition's clearing logged a warning. So the values
        go straight to the storage units, which mark them ready in the controller; a TQ client without
        that storage manager takes the full `put`."""
        client = self._async_client()
        put_data = getattr(getattr(client, "storage_manager", None), "put_data", None)
        if put_data is None:
            await self._call("put", data, metadata=meta)
            return
        await put_data(data, meta)

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
        config = {"sampler": sampler, "num_ranks": num_ranks}
        fields = sorted({ROWS_FIELD if c in ROW_COLUMNS else c for c in columns})
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        longest = POLL_MAX_S if poll_max_s is None else poll_max_s
        wait = min(POLL_S, longest)
        started = warned = time.monotonic()
        listener = self._listener()
        # with a doorbell: poll when the rings say the rows this task has not taken yet may be there
        expected = batch_size + (listener.taken(partition, task) if listener is not None else 0)
        while True:
            if listener is not None:
                listener.drain()
                seen = listener.rings(partition)  # before the poll: a ring during it wakes the wait
            meta = await self._call(
                "get_meta",
                data_fields=fields,
                batch_size=batch_size,
                partition_id=partition,
                mode="fetch",
                task_name=task,
                sampling_config=config,
            )
            if meta.size:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    f"data plane: {task!r} waited {timeout_s}s for {batch_size} rows with {columns} "
                    f"in {partition!r}"
                )
            if time.monotonic() - warned >= dp.STALL_WARN_S:
                warned = time.monotonic()
                await self._warn_stalled(partition, columns, task, batch_size, sampler, warned - started)
            if listener is not None:
                left = doorbell.BELL_FALLBACK_S if deadline is None else deadline - time.monotonic()
                await listener.wait(
                    partition, fields, expected, seen, max(0.0, min(doorbell.BELL_FALLBACK_S, left))
                )
                continue
            await asyncio.sleep(wait)
            wait = min(wait * 2, longest)
        data = await self._call("get_data", meta)
        if listener is not None:
            listener.took(partition, task, meta.size)
        self._taken[partition] = meta
        self._taken.move_to_end(partition)
        while len(self._taken) > TAKEN_PARTITIONS:
            self._taken.popitem(last=False)
        n = meta.size
        rows = _to_values(data[ROWS_FIELD], n) if ROWS_FIELD in fields else []
        out = {}
        for c in columns:
            if c not in ROW_COLUMNS:
                out[c] = _to_values(data[c], n)
            elif missing := sum(c not in r for r in rows):
                raise KeyError(f"data plane: {missing} rows of {partition!r} have no column {c!r}")
            else:
                out[c] = [r[c] for r in rows]
        return DataBatch(list(meta.global_indexes), out)

    async def _warn_stalled(
        self, partition: str, columns: list[str], task: str, batch_size: int, sampler: str, waited: float
    ) -> None:
        """Say what a long wait is waiting for, with how many rows the partition holds (any columns)."""
        meta = await self._call(
            "get_meta", data_fields=[], batch_size=1, partition_id=partition, mode="force_fetch"
        )
        logger.info(
            "data plane: %r still waiting after %.0f s for %d rows with %s of %r (sampler %s); it holds %d rows",
            task,
            waited,
            batch_size,
            columns,
            partition,
            sampler,
            meta.size,
        )

    async def clear(self, partition: str) -> None:
        self._taken.pop(partition, None)
        await self._call("clear_partition", partition)
        self._ring(partition, doorbell.CLEARED)

    async def close(self) -> None:
        import transfer_queue as tq

        listeners, self._listeners = list(self._listeners.values()), weakref.WeakKeyDictionary()
        for listener in listeners:
            listener.close()
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        clients, self._clients = list(self._clients.values()), weakref.WeakKeyDictionary()
        for client in clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("closing a TransferQueue client failed")
        if self._actors is not None:  # started here: TQ's module state knows nothing of it
            actors, self._actors = self._actors, None
            try:
                self.client.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("closing the TransferQueue client failed")
            await asyncio.to_thread(actors.close)
        else:
            await asyncio.to_thread(tq.close)
        if self._hub is not None:
            self._hub.close()
            self._hub = None
