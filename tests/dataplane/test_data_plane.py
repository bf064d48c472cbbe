"""The data-plane contract, for the in-process plane and TransferQueue: rows and columns from different
producers, consumers tracked by task name, `get` blocking until the requested columns exist, clear."""

from __future__ import annotations

import asyncio

import pytest

from relax.dataplane.plane import LocalDataPlane


def rows(n, group_size=2):
    return [
        {"prompt_ids": [1, 2], "response_ids": [3] * (i + 1), "group_id": i // group_size, "length": 3 + i}
        for i in range(n)
    ]


async def contract(plane):
    ids = await plane.put_rows("p", rows(4))
    assert len(ids) == 4
    # A consumer of a column nobody wrote yet blocks (times out here) ...
    with pytest.raises(TimeoutError):
        await plane.get("p", ["prompt_ids", "log_probs"], "adv", 4, timeout_s=0.3)
    # ... while a consumer of existing columns gets the rows, once per task.
    got = await plane.get("p", ["prompt_ids", "response_ids"], "fwd", 4, timeout_s=5)
    assert sorted(got.indexes) == sorted(ids)
    assert got.columns["response_ids"][got.indexes.index(ids[2])] == [3, 3, 3]
    with pytest.raises(TimeoutError):
        await plane.get("p", ["prompt_ids"], "fwd", 1, timeout_s=0.3)  # fwd consumed them all
    # A waiting consumer wakes up when the last producer writes its column.
    waiter = asyncio.create_task(plane.get("p", ["log_probs", "group_id"], "adv", 4, timeout_s=10))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    await plane.put_columns("p", got.indexes[:2], {"log_probs": [[-1.0], [-2.0]]})
    await asyncio.sleep(0.2)
    assert not waiter.done()  # two rows still lack log_probs
    await plane.put_columns("p", got.indexes[2:], {"log_probs": [[-3.0], [-4.0]]})
    out = await waiter
    assert sorted(out.indexes) == sorted(ids)
    lp = dict(zip(out.indexes, out.columns["log_probs"], strict=True))
    assert lp[got.indexes[0]] == [-1.0] and lp[got.indexes[3]] == [-4.0]
    assert sorted(out.columns["group_id"]) == [0, 0, 1, 1]
    # Whole-group sampling hands out complete groups only.
    more = await plane.put_rows("q", rows(3))
    g = await plane.get("q", ["group_id"], "actor", 2, sampler="whole_groups", timeout_s=5)
    assert sorted(g.indexes) == sorted(more[:2])
    with pytest.raises(TimeoutError):  # group 1 has one of its two rows
        await plane.get("q", ["group_id"], "actor", 2, sampler="whole_groups", timeout_s=0.3)
    await plane.clear("p")
    await plane.clear("q")
    with pytest.raises(TimeoutError):
        await plane.get("p", ["prompt_ids"], "new_task", 1, timeout_s=0.3)


async def packed_rows(plane):
    """TransferQueue keeps the Rollout's columns packed in one field: every value comes back as written,
    and a row column the Rollout does not write, or a Rollout column written later, is refused."""
    from relax.data.columns import ROLLOUT_COLUMNS

    row = {
        "prompt_ids": [1, 2],
        "response_ids": [3, 4, 5],
        "loss_mask": [1, 1, 0],
        "rollout_log_probs": [-0.5, -1.25, -2.0],
        "reward": 0.75,
        "group_id": 7,
        "weight_versions": [2, 3],
        "length": 5,
        "multimodal_inputs": "",
    }
    assert sorted(row) == sorted(ROLLOUT_COLUMNS)
    ids = await plane.put_rows("r", [row, {**row, "reward": 0.0}])
    await plane.put_columns("r", ids, {"advantages": [[1.0, 1.0, 0.0], [-1.0, -1.0, 0.0]]})
    got = await plane.get("r", [*ROLLOUT_COLUMNS, "advantages"], "actor", 2, timeout_s=5)
    first = {c: got.columns[c][got.indexes.index(ids[0])] for c in got.columns}
    assert first == {**row, "advantages": [1.0, 1.0, 0.0]}
    with pytest.raises(ValueError, match="not Rollout columns.*ROLLOUT_COLUMNS"):
        await plane.put_rows("r", [{**row, "score": 1.0}])
    with pytest.raises(ValueError, match="written only with put_rows"):
        await plane.put_columns("r", ids, {"reward": [1.0, 1.0]})
    await plane.clear("r")


def test_local_data_plane_contract():
    asyncio.run(contract(LocalDataPlane()))


@pytest.mark.slow
def test_transferqueue_data_plane_contract(ray_cluster, monkeypatch):
    from transfer_queue.client import AsyncTransferQueueClient

    from relax.dataplane.transferqueue import TransferQueueDataPlane

    sent = []  # custom meta sent to the controller: by put_rows only, never again by put_columns
    original = AsyncTransferQueueClient.async_set_custom_meta

    async def counting(self, metadata, *args, **kwargs):
        sent.append(sorted(set(metadata.partition_ids)))
        return await original(self, metadata, *args, **kwargs)

    monkeypatch.setattr(AsyncTransferQueueClient, "async_set_custom_meta", counting)
    plane = TransferQueueDataPlane.create()
    try:
        asyncio.run(contract(plane))
        asyncio.run(packed_rows(plane))
    finally:
        asyncio.run(plane.close())
    assert sent == [["p"], ["q"], ["r"]]


def test_roles_connect_to_the_plane_on_first_use():
    """Roles are built while the Controller still starts the plane: construction must not connect."""
    from relax.dataplane.plane import PlaneClient

    class Role(PlaneClient):
        def __init__(self, kind: str, plane=None) -> None:
            self._plane, self._plane_kind = plane, kind

    role = Role("no-such-plane")  # would fail here if the constructor connected
    with pytest.raises(ValueError, match="unknown schedule.data_plane 'no-such-plane'"):
        _ = role.plane
    given = LocalDataPlane()
    assert Role("no-such-plane", given).plane is given


def test_row_writer_coalesces_concurrent_writes_and_reports_errors():
    """Writes that arrive while a put is in flight go out together; each returns once its rows are in,
    and a failed put raises in every write it carried, not in later ones."""
    from relax.dataplane.plane import RowWriter

    class SlowPlane(LocalDataPlane):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[int] = []
            self.fail_next = False

        async def put_rows(self, partition, rows):
            self.calls.append(len(rows))
            await asyncio.sleep(0.05)
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("storage unit gone")
            return await super().put_rows(partition, rows)

    async def main():
        plane = SlowPlane()
        writer = RowWriter(plane)
        await asyncio.gather(*(writer.write("p", rows(2)) for _ in range(3)))  # arrived together
        first = asyncio.create_task(writer.write("p", rows(2)))
        await asyncio.sleep(0.01)
        await asyncio.gather(first, *(writer.write("p", rows(2)) for _ in range(4)))
        assert plane.calls == [6, 2, 8]  # four waited for the put in flight, then went together
        assert writer.puts == 3 and len(plane.partitions["p"].rows) == 16
        await writer.write("p", rows(1))  # a lone write goes out at once
        assert plane.calls[-1] == 1
        plane.fail_next = True
        first = asyncio.create_task(writer.write("q", rows(2)))
        await asyncio.sleep(0.01)
        later = [asyncio.create_task(writer.write("q", rows(2))) for _ in range(2)]
        with pytest.raises(RuntimeError, match="storage unit gone"):
            await first
        await asyncio.gather(*later)  # carried by the next put, which succeeds
        assert len(plane.partitions["q"].rows) == 4 and not writer._drains

    asyncio.run(main())


def test_row_writer_waits_for_a_batch_of_writes_or_the_partitions_last():
    """`writes_per_put`: a put carries at least that many writes, except the partition's last ones; each
    write returns once its rows are in."""
    from relax.dataplane.plane import RowWriter

    class CountingPlane(LocalDataPlane):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[int] = []

        async def put_rows(self, partition, rows):
            self.calls.append(len(rows))
            return await super().put_rows(partition, rows)

    async def main():
        plane = CountingPlane()
        writer = RowWriter(plane, writes_per_put=4, writes_per_partition=6)
        first = [asyncio.create_task(writer.write("p", rows(2))) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert plane.calls == [] and not any(t.done() for t in first)  # 3 of 4: nothing put yet
        await asyncio.gather(writer.write("p", rows(2)), *first)
        assert plane.calls == [8]
        fifth = asyncio.create_task(writer.write("p", rows(2)))
        await asyncio.sleep(0.1)
        assert not fifth.done()
        await asyncio.gather(writer.write("p", rows(1)), fifth)  # the partition's last write: put now
        assert plane.calls == [8, 3] and len(plane.partitions["p"].rows) == 11
        assert not writer._written and not writer._drains  # the finished partition is forgotten
        with pytest.raises(ValueError, match="writes_per_partition"):
            RowWriter(plane, writes_per_put=2)

    asyncio.run(main())


def test_fully_async_puts_a_step_at_once_when_every_reader_takes_it_whole(tiny_model_dir, arith_file):
    from relax.config import load_config
    from relax.config.modes import groups_per_put

    def per_put(*overrides: str) -> int:
        base = [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            "rollout.prompts_per_step=16",
        ]
        return groups_per_put(load_config(None, [*base, *overrides]))

    whole = ["schedule.mode=fully_async", "algorithm.old_log_probs=rollout", "algorithm.kl_coef=0.0"]
    assert per_put(*whole) == 16  # Advantages and the Actor: whole steps
    assert per_put(*whole[:2], "algorithm.kl_coef=0.1") == 4  # Reference forwards quarter steps
    assert per_put("schedule.mode=fully_async", "algorithm.old_log_probs=recompute") == 4  # ActorFwd
    assert per_put("schedule.mode=hybrid") == per_put("schedule.mode=colocate") == 1


class _Partition:
    """The part of a TransferQueue partition `RelaxTQSampler` reads: every row's index and the custom meta
    that has arrived so far."""

    def __init__(self, n: int, meta: dict[int, dict]) -> None:
        self.global_indexes = set(range(n))
        self.meta = meta

    def get_custom_meta(self, indexes):
        return {i: self.meta[i] for i in indexes if i in self.meta}


def test_tq_sampler_serves_rows_only_after_their_group_id_arrives():
    """TQ's put marks a row ready before it sets the row's custom meta. Rows caught in between must wait:
    taken as groups of one, they split real groups, and the rest of a split group never formed a
    whole-group batch again (hybrid's Actor stalled on its last sub-batch)."""
    from relax.dataplane.transferqueue import RelaxTQSampler

    sampler = RelaxTQSampler()
    # Rows 0-3: group 0, meta set. Rows 4-7 (groups 1 and 2) are ready, their meta still in flight.
    meta = {i: {"group_id": 0, "length": 5} for i in range(4)}
    part = _Partition(8, meta)
    for name in ("whole_groups", "sequential", "seqlen_balanced"):
        chosen, consumed = sampler.sample(list(range(8)), 8, partition=part, sampler=name)
        assert chosen == [] and consumed == [], name
    chosen, _ = sampler.sample(list(range(8)), 4, partition=part, sampler="whole_groups")
    assert chosen == [0, 1, 2, 3]
    meta.update({i: {"group_id": 1 + (i >= 6), "length": 5} for i in range(4, 8)})
    chosen, _ = sampler.sample(list(range(4, 8)), 2, partition=part, sampler="whole_groups")
    assert chosen == [4, 5]
    # A row written without a group id is a group of its own.
    meta[8] = {"group_id": None, "length": 2}
    part.global_indexes.add(8)
    chosen, _ = sampler.sample([8], 1, partition=part, sampler="whole_groups")
    assert chosen == [8]


class _StalledClient:
    """A TransferQueue client whose partition holds 3 rows, none ready for the waiting task."""

    class _Meta:
        def __init__(self, size: int) -> None:
            self.size = size
            self.global_indexes = list(range(size))

    def get_meta(self, mode, **kwargs):
        return self._Meta(3 if mode == "force_fetch" else 0)


def test_tq_plane_warns_while_a_wait_stalls(monkeypatch, caplog):
    """A consumer that waits long for rows says so (INFO, again every interval), naming what it waits for and
    how many rows the partition holds, instead of hanging silently; it still times out when asked."""
    import relax.dataplane.plane as dp
    from relax.dataplane.transferqueue import TransferQueueDataPlane

    monkeypatch.setattr(dp, "STALL_WARN_S", 0.05)

    async def stall_local():
        local = LocalDataPlane()
        await local.put_rows("train_1", rows(3, group_size=4))  # one group of 3: no batch of 2 whole rows
        await local.get("train_1", ["reward"], "actor", 2, sampler="whole_groups", timeout_s=0.4)

    for plane, run, held in [
        ("tq", lambda: TransferQueueDataPlane(_StalledClient()).get(
            "train_1", ["reward"], "actor", 8, sampler="whole_groups", timeout_s=0.4), "holds 3 rows"),
        ("local", stall_local, "'rows': 3"),
    ]:  # fmt: skip
        caplog.clear()
        with caplog.at_level("INFO", logger="relax.dataplane"):
            with pytest.raises(TimeoutError):
                asyncio.run(run())
        warnings = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
        assert len(warnings) >= 2, (plane, warnings)
        assert "'actor'" in warnings[0] and "rows with ['reward'] of 'train_1'" in warnings[0], warnings
        assert "whole_groups" in warnings[0] and held in warnings[0], warnings


def test_tq_plane_refuses_values_that_are_not_plain():
    """Values cross TransferQueue as msgpack: a tensor handed to `put_columns` is refused with the fix."""
    import torch

    from relax.dataplane.transferqueue import _tensordict, _to_values

    packed = _tensordict({"advantages": [[1.0, -0.5], [2.0]], "reward": [1.0, 0.0]}, 2)
    assert _to_values(packed["advantages"], 2) == [[1.0, -0.5], [2.0]]
    with pytest.raises(TypeError, match="'log_probs'.*tensor_column"):
        _tensordict({"log_probs": [torch.tensor([0.5])]}, 1)
