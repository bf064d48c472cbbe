"""The data-plane contract, for the in-process plane and TransferQueue: rows and columns from different
producers, consumers tracked by task name, `get` blocking until the requested columns exist, clear."""

from __future__ import annotations

import asyncio

import pytest

from relax.distributed.data_plane import LocalDataPlane


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


def test_local_data_plane_contract():
    asyncio.run(contract(LocalDataPlane()))


@pytest.mark.slow
def test_transferqueue_data_plane_contract(ray_cluster):
    from relax.distributed.tq_data_plane import TransferQueueDataPlane

    plane = TransferQueueDataPlane.create()
    try:
        asyncio.run(contract(plane))
    finally:
        asyncio.run(plane.close())


def test_roles_connect_to_the_plane_on_first_use():
    """Roles are built while the Controller still starts the plane: construction must not connect."""
    from relax.distributed.data_plane import PlaneClient

    class Role(PlaneClient):
        def __init__(self, kind: str, plane=None) -> None:
            self._plane, self._plane_kind = plane, kind

    role = Role("no-such-plane")  # would fail here if the constructor connected
    with pytest.raises(ValueError, match="unknown resources.data_plane 'no-such-plane'"):
        _ = role.plane
    given = LocalDataPlane()
    assert Role("no-such-plane", given).plane is given
