"""Start-up objects of a role's process are frozen out of the cyclic collector (relax/utils/gc_freeze.py),
also when the role class travels to a Ray actor; a Ray worker that imports Relax collects generation 0
less often until its role is built."""

from __future__ import annotations

import gc
import sys
import uuid

import pytest

from relax.utils import gc_freeze
from relax.utils.gc_freeze import with_frozen_startup
from tests.utils.gc_probe import Probe, StartupProbe


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


def test_quiet_startup_raises_generation_0_until_the_start_up_is_frozen(monkeypatch):
    default = gc.get_threshold()
    monkeypatch.setattr(gc_freeze, "_default_thresholds", None)
    try:
        gc_freeze.quiet_startup()
        assert gc.get_threshold() == (gc_freeze.STARTUP_GEN0_THRESHOLD, *default[1:])
        assert gc.get_freeze_count() > 1000  # what was loaded before: Ray's modules in a worker
        gc_freeze.quiet_startup()  # once per process: a second call keeps the saved defaults
        gc_freeze.freeze_startup_objects()
        assert gc.get_threshold() == default
    finally:
        gc.set_threshold(*default)
        gc.unfreeze()


@pytest.mark.parametrize(
    ("argv0", "worker"),
    [
        ("/venv/lib/python3.11/site-packages/ray/_private/workers/default_worker.py", True),
        ("/venv/bin/relax", False),
        ("/venv/bin/pytest", False),
    ],
)
def test_only_ray_workers_count_as_such(monkeypatch, argv0, worker):
    monkeypatch.setattr(sys, "argv", [argv0])
    assert gc_freeze.started_as_ray_worker() is worker


def test_a_fresh_ray_worker_that_imports_relax_collects_less_until_its_role_is_built(ray_cluster):
    import ray

    # a runtime env of its own: a fresh worker process, not one that imported Relax for an earlier test
    env = {"env_vars": {"RELAX_TEST_FRESH_WORKER": uuid.uuid4().hex}}
    actor = ray.remote(StartupProbe).options(runtime_env=env).remote()
    try:
        before, during, after = ray.get(actor.thresholds.remote(), timeout=120)
    finally:
        ray.kill(actor)
    assert before == after and before[0] < gc_freeze.STARTUP_GEN0_THRESHOLD
    assert during == (gc_freeze.STARTUP_GEN0_THRESHOLD, *before[1:])


def test_the_collector_is_paused_inside_and_left_as_it_was_after():
    assert gc.isenabled()
    with gc_freeze.collector_paused():
        assert not gc.isenabled()
        with gc_freeze.collector_paused():  # nested: the outer one turns it back on
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_freeze.collector_paused():
        raise RuntimeError("an error inside the burst")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_freeze.collector_paused():
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()


PLANE_ROLE = """
import gc, sys
import torch  # a role's start-up has torch, as every role does
from relax.dataplane.plane import PlaneClient
from relax.utils.gc_freeze import with_frozen_startup

class Role(PlaneClient):
    def __init__(self, kind):
        self._use_plane(None, kind)

assert "transfer_queue" not in sys.modules
with_frozen_startup(Role)(sys.argv[1])
loaded = "transfer_queue" in sys.modules
import relax.dataplane.transferqueue  # the first write's import: nothing new if it was loaded before
gc.collect()
print(loaded, len(gc.get_objects()))
"""


@pytest.mark.parametrize("kind", ["transferqueue", "ray"])
def test_a_roles_data_plane_client_is_loaded_before_its_start_up_is_frozen(kind):
    """The TransferQueue client (tensordict, torch._dynamo: ~150 thousand objects) imported at a role's
    first write stayed with the collector, every full collection of a step walking it."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", PLANE_ROLE, kind], capture_output=True, text=True, timeout=240, check=True
    ).stdout.split()
    loaded, tracked = out[0] == "True", int(out[1])
    if kind == "transferqueue":
        assert loaded and tracked < 20_000
    else:  # the Ray plane needs no client of its own; a later import is left to the collector
        assert not loaded and tracked > 50_000
