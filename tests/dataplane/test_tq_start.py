"""TransferQueue's actors started by Relax (relax/dataplane/tq_start.py): placed by Ray with the options
given, and a start that cannot be placed fails by its deadline, naming the keys, with nothing left."""

from __future__ import annotations

import asyncio

import pytest


def test_the_data_plane_actors_take_the_options_given(ray_cluster):
    import ray

    from relax.dataplane.tq_start import CONTROLLER_NAME, NAMESPACE
    from relax.dataplane.transferqueue import TransferQueueDataPlane

    plane = TransferQueueDataPlane.create(actor_options={"num_cpus": 0.5})
    try:
        actors = plane._actors
        assert len(actors.units) == 1
        controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        assert controller._actor_id == actors.controller._actor_id
        assert asyncio.run(plane.put_rows("p", [{"prompt_ids": [1], "group_id": 0}])) == [0]
    finally:
        asyncio.run(plane.close())
    with pytest.raises(ValueError):  # closed: a later run starts a fresh one
        ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)


def test_a_data_plane_that_cannot_be_placed_fails_by_its_deadline_naming_the_keys(ray_cluster):
    import ray

    from relax.dataplane.tq_start import CONTROLLER_NAME, NAMESPACE, DataPlaneStartError
    from relax.dataplane.transferqueue import TransferQueueDataPlane

    with pytest.raises(DataPlaneStartError) as e:
        TransferQueueDataPlane.create(actor_options={"resources": {"no_such_node": 1}}, timeout_s=3)
    assert "resources.placement.data_plane" in str(e.value) and "no_such_node" in str(e.value)
    with pytest.raises(ValueError):  # the controller it made was removed
        ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
