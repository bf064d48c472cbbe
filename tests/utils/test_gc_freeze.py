"""Start-up objects of a role's process are frozen out of the cyclic collector (relax/utils/gc_freeze.py),
also when the role class travels to a Ray actor."""

from __future__ import annotations

import gc

from relax.utils.gc_freeze import with_frozen_startup
from tests.utils.gc_probe import Probe


def test_constructing_the_wrapped_class_freezes_in_this_process():
    assert gc.get_freeze_count() == 0
    try:
        probe = with_frozen_startup(Probe)(7)
        assert isinstance(probe, Probe) and probe.payload == 7
        assert probe.frozen() > 1000  # everything imported so far, this test's objects included
    finally:
        gc.unfreeze()  # the test process collects as usual again


def test_a_ray_actor_of_the_wrapped_class_runs_the_wrapper(ray_cluster):
    import ray

    plain = ray.remote(Probe).remote(1)
    wrapped = ray.remote(with_frozen_startup(Probe)).remote(1)
    assert ray.get(plain.frozen.remote()) == 0  # Ray's workers do not freeze by themselves
    assert ray.get(wrapped.frozen.remote()) > 1000  # pickled by value: the subclass's __init__ ran
    for actor in (plain, wrapped):
        ray.kill(actor)
