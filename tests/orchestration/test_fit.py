"""The fit check (relax/orchestration/fit.py) on node tables as `ray.nodes()` gives them: what the roles of
the quickstart ask for, placed one actor per node, and the errors for clusters that cannot host them."""

from __future__ import annotations

import pytest

from relax.config import load_config
from relax.orchestration import gpus
from relax.orchestration.fit import Demand, FitError, Node, check_fit, labels_match, run_demand
from relax.orchestration.preflight import PreflightError
from relax.orchestration.registry import RoleSpec, roles_for


def node(address: str, cpus: float, labels: dict | None = None, **custom: float) -> Node:
    entry = {
        "NodeManagerAddress": address,
        "Alive": True,
        "Resources": {"CPU": cpus, f"node:{address}": 1.0, "memory": 1e9, **custom},
        "Labels": labels or {},
    }
    return Node.from_ray(entry)


def quickstart(*overrides: str):
    cfg = load_config("examples/quickstart.yaml", list(overrides))
    gpus.plan_gpus(cfg, 0)
    specs = [RoleSpec("metrics", object, 0.25), *roles_for(cfg)]
    return cfg, run_demand(cfg, specs)


def test_the_quickstart_asks_for_its_roles_an_engine_and_the_data_plane():
    _, demands = quickstart()
    asked = {d.what: d.resources["CPU"] for d in demands}
    # metrics 0.25 + rollout 1 + actor 1 + one engine 1 + TransferQueue's controller and storage unit 1 each
    assert asked == {
        "role metrics": 0.25,
        "role rollout": 1.0,
        "role actor": 1.0,
        "embedded engine 0": 1.0,
        "TransferQueue controller": 1.0,
        "TransferQueue storage unit 0": 1.0,
    }


def test_a_head_with_no_cpu_hosts_nothing_and_two_4_cpu_workers_host_everything():
    _, demands = quickstart()
    placed = check_fit(demands, [node("10.0.0.1", 0), node("10.0.0.2", 4), node("10.0.0.3", 4)])
    assert placed["10.0.0.1"] == []
    assert sorted(placed["10.0.0.2"] + placed["10.0.0.3"]) == sorted(d.what for d in demands)


def test_2_cpu_workers_are_too_small_and_the_error_names_the_shortfall_and_the_keys():
    _, demands = quickstart()
    with pytest.raises(FitError) as e:
        check_fit(demands, [node("10.0.0.1", 1), node("10.0.0.2", 2), node("10.0.0.3", 2)])
    msg = str(e.value)
    # 5.25 CPUs asked, 5 offered: the smallest actor (metrics, 0.25) is the one left over
    assert "asks for {CPU: 5.25, GPU: 0} in all" in msg and "offer {CPU: 5, GPU: 0}" in msg
    assert "short by {CPU: 0.25}" in msg
    assert "role metrics asks for {CPU: 0.25, GPU: 0}; once the actors before it are placed" in msg
    assert "resources.placement.metrics" in msg
    assert isinstance(e.value, PreflightError)  # `relax train` reports it as a config problem (exit 1)


def test_an_actor_larger_than_every_node_names_the_largest_node_and_its_keys():
    _, demands = quickstart("rollout.num_engines=2")
    demands.append(Demand("training rank 0", ("trainer.cpus_per_rank",), {"CPU": 6.0, "GPU": 0.0}))
    with pytest.raises(FitError) as e:
        check_fit(demands, [node("10.0.0.1", 0), node("10.0.0.2", 4), node("10.0.0.3", 4)])
    msg = str(e.value)
    assert (
        "training rank 0 asks for {CPU: 6, GPU: 0}; the largest node (10.0.0.2) has {CPU: 4, GPU: 0}" in msg
    )
    assert "trainer.cpus_per_rank" in msg
    assert "short by {CPU: 4.25}" in msg  # 5.25 + a second engine + 6 asked, 8 offered
    assert "rollout.num_engines" not in msg  # the engines fit


def test_labels_and_custom_resources_pick_the_nodes():
    cfg, demands = quickstart(
        "resources.placement={engines: {label_selector: {tier: engine}, resources: {engine_slot: 1}}, "
        "data_plane: {label_selector: {tier: cpu}}}"
    )
    nodes = [
        node("10.0.0.1", 0),
        node("10.0.0.2", 6, {"tier": "cpu"}),
        node("10.0.0.3", 3, {"tier": "engine"}, engine_slot=1.0),
    ]
    placed = check_fit(demands, nodes)
    assert placed["10.0.0.3"] == ["embedded engine 0"]
    assert {"TransferQueue controller", "TransferQueue storage unit 0"} <= set(placed["10.0.0.2"])

    two = run_demand(
        cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"num_engines": 2})}), []
    )
    with pytest.raises(FitError, match=r"embedded engine 1 asks for \{CPU: 1, GPU: 0, engine_slot: 1\}"):
        check_fit(two, nodes)  # one engine slot in the cluster
    with pytest.raises(FitError, match=r"needs node labels \{'tier': 'cpu'\}; no node has them"):
        check_fit(demands, [node("10.0.0.1", 8, {"tier": "engine"}, engine_slot=1.0)])


def test_label_selector_syntax():
    labels = {"tier": "cpu", "zone": "a"}
    assert labels_match({}, labels)
    assert labels_match({"tier": "cpu"}, labels) and not labels_match({"tier": "gpu"}, labels)
    assert labels_match({"tier": "!gpu"}, labels) and not labels_match({"tier": "!cpu"}, labels)
    assert labels_match({"zone": "in(a, b)"}, labels) and not labels_match({"zone": "!in(a,b)"}, labels)
    assert not labels_match({"rack": "r1"}, labels) and labels_match({"rack": "!r1"}, labels)
