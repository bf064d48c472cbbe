"""`resources.rollout_cpus` / `resources.training_cpus` on a real Ray cluster: a Serve role deployed with
a CPU budget and an embedded engine actor run, with every thread, on the CPUs of their budget."""

from __future__ import annotations

import os

import pytest

from relax.config import load_config
from relax.orchestration import service
from relax.orchestration.registry import roles_for
from tests.orchestration.cpu_probe import Probe

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2, reason="needs Linux and 2+ CPUs"
)


def thread_affinities(pid: int) -> list[set[int]]:
    """The CPUs of each thread of process `pid`; a thread that ends between the listing and its query
    (a Ray worker starts and ends short-lived threads) is left out: it runs nowhere."""
    cpus = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            cpus.append(os.sched_getaffinity(int(t)))
        except ProcessLookupError:
            continue
    return cpus


def test_every_role_has_its_budget():
    budgets = {
        r.name: r.budget
        for r in roles_for(
            load_config(None, ["model.path=m", "data.train_files=[d]", "schedule.mode=fully_async"])
        )
    }
    assert budgets == {
        "rollout": "rollout",
        "actor": "training",
        "actor_fwd": "training",
        "advantages": "rollout",
    }


def test_a_role_deployed_with_a_budget_runs_on_its_cpus(ray_cluster):
    from ray import serve

    last = max(os.sched_getaffinity(0))
    service.start_serve()
    try:
        role = service.RoleDeployment("cpu_probe", Probe, (None,), num_cpus=0.1, cpus=str(last))
        handle = service.deploy_roles([role])["cpu_probe"]
        pid = handle.pid.remote().result()
        assert all(cpus == {last} for cpus in thread_affinities(pid))
    finally:
        serve.delete("cpu_probe")


def test_embedded_engines_run_on_the_rollout_cpus(ray_cluster, tiny_model_dir):
    import ray

    from relax.backends.inference.engine_actors import EngineGroup

    first = min(os.sched_getaffinity(0))
    group = EngineGroup(
        str(tiny_model_dir), 1, {"threads": 1, "max_running": 8}, num_cpus=0.1, cpus=str(first)
    )
    try:
        pid = ray.get(group.actors[0].__ray_call__.remote(lambda self: os.getpid()))
        affinities = thread_affinities(pid)
        assert len(affinities) > 3 and all(cpus == {first} for cpus in affinities)
    finally:
        group.stop()
