"""Will the run fit the cluster? What the roles will ask Ray for, compared with the nodes before any role
starts, so a run that cannot be placed stops in seconds naming what is short and the keys that change it,
instead of a role waiting for a node that never comes.

`run_demand(cfg, specs)` lists every actor the run starts at start-up with its Ray resources and node
labels: the Serve replica of each role, the embedded engines (the Rollout's and GenRM's), the training
ranks, the reward workers, TransferQueue's controller and storage units, and the colocate GPU group's
bundles. Serve's own controller asks for no CPU and its HTTP proxies are off, so neither counts.
`check_fit(demands, nodes)` places them on the nodes' total resources the way a packer would: each actor
on one node (an actor never spans nodes), the largest first, each on the eligible node with the most
room left. An actor that fits nowhere, or that no longer fits once the others are placed, is a
`FitError`. The nodes' free resources are not the test (another run's actors come and go), but a
placement that fits only the totals is logged as a warning.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from relax.config import RelaxConfig
from relax.orchestration.preflight import PreflightError

logger = logging.getLogger(__name__)

COUNTED = ("CPU", "GPU")  # Ray's own resources a demand names even at 0; custom ones appear when asked
EPS = 1e-9
GPU_GROUP_BUNDLE_CPUS = 2.0  # gpus.ensure_gpu_group's bundle: one GPU and two CPUs


class FitError(PreflightError):
    """The run's actors cannot all be placed on the cluster's nodes; says what is short and what to change."""


@dataclass(frozen=True)
class Demand:
    """One actor the run starts: what it is, the config keys that size or place it, its Ray resources
    (CPU, GPU, custom) and the node labels it needs."""

    what: str
    keys: tuple[str, ...]
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Node:
    """One live Ray node: its address, total resources and labels (from `ray.nodes()`)."""

    address: str
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_ray(cls, entry: dict[str, Any]) -> Node:
        res = {k: float(v) for k, v in (entry.get("Resources") or {}).items() if not k.startswith("node:")}
        return cls(entry.get("NodeManagerAddress", "?"), res, dict(entry.get("Labels") or {}))


def _demand(what: str, keys: tuple[str, ...], cpus: float, gpus: float, placement: dict[str, Any]) -> Demand:
    res = {"CPU": float(cpus), "GPU": float(gpus or 0.0), **placement.get("resources", {})}
    return Demand(what, keys, res, dict(placement.get("label_selector", {})))


def run_demand(cfg: RelaxConfig, specs: list[Any], cluster_gpus: int = 0) -> list[Demand]:
    """Every actor the run starts before its first step (`specs`: the roles' `RoleSpec`s), with the
    GPU shares already planned (`gpus.plan_gpus`) for a cluster of `cluster_gpus` GPUs."""
    from relax.backends.inference.registry import engine_backend
    from relax.orchestration.gpus import role_gpus
    from relax.utils.placement import ray_placement

    r, t, ro = cfg.resources, cfg.trainer, cfg.rollout
    out = [
        _demand(
            f"role {s.name}",
            (f"resources.placement.{s.name}",),
            s.num_cpus,
            role_gpus(cfg, s.name),
            ray_placement(cfg, s.name),
        )
        for s in specs
    ]
    gpu_group = cfg.schedule.mode == "colocate" and bool(r.engine_gpus and r.trainer_gpus and t.uses_group)
    if gpu_group and r.gpu_group is None:  # created by the run: one bundle per GPU of the cluster
        bundle = {"GPU": 1.0, "CPU": GPU_GROUP_BUNDLE_CPUS}
        out += [
            Demand(f"colocate GPU group bundle {i}", ("resources.num_gpus",), bundle)
            for i in range(cluster_gpus)
        ]
    if engine_backend(ro.engine).in_cluster and not (gpu_group and r.engine_gpus):
        keys = ("rollout.num_engines", "resources.engine_gpus", "resources.placement.engines")
        out += [
            _demand(f"{ro.engine} engine {i}", keys, 1.0, r.engine_gpus or 0.0, ray_placement(cfg, "engines"))
            for i in range(ro.num_engines)
        ]
    if t.uses_group and not (gpu_group and r.trainer_gpus):
        keys = ("trainer.num_ranks", "trainer.cpus_per_rank", "resources.placement.ranks")
        out += [
            _demand(
                f"training rank {i}",
                keys,
                t.cpus_per_rank,
                r.trainer_gpus or 0.0,
                ray_placement(cfg, "ranks"),
            )
            for i in range(t.num_ranks)
        ]
    if cfg.reward.num_workers:
        keys = ("reward.num_workers", "reward.worker_cpus")
        out += [
            _demand(f"reward worker {i}", keys, cfg.reward.worker_cpus, 0.0, {})
            for i in range(cfg.reward.num_workers)
        ]
    g = cfg.reward.genrm
    if g is not None and not g.engine_urls:
        keys = ("reward.genrm.num_engines", "reward.genrm.engine_cpus", "resources.placement.engines")
        out += [
            _demand(f"GenRM engine {i}", keys, g.engine_cpus, 0.0, ray_placement(cfg, "engines"))
            for i in range(g.num_engines)
        ]
    if cfg.schedule.data_plane == "transferqueue":
        keys = ("resources.data_plane_cpus", "resources.placement.data_plane")
        place = ray_placement(cfg, "data_plane")
        out.append(_demand("TransferQueue controller", keys, r.data_plane_cpus, 0.0, place))
        out.append(_demand("TransferQueue storage unit 0", keys, r.data_plane_cpus, 0.0, place))
    return out


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Ray's label selector: `value`, `!value`, `in(a,b)`, `!in(a,b)` per key."""
    for key, want in selector.items():
        have = labels.get(key)
        negate = want.startswith("!")
        want = want[1:] if negate else want
        m = re.fullmatch(r"in\((.*)\)", want)
        ok = have in [v.strip() for v in m.group(1).split(",")] if m else have == want
        if ok == negate:
            return False
    return True


def _fits(need: dict[str, float], room: dict[str, float]) -> bool:
    return all(v <= room.get(k, 0.0) + EPS for k, v in need.items() if v > 0)


def _only(res: dict[str, float], d: Demand) -> dict[str, float]:
    """`res` restricted to what `d` asks for (a node also lists memory and object store bytes)."""
    return {k: res.get(k, 0.0) for k in d.resources}


def _fmt(res: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in res.items() if v > 0 or k in COUNTED) + "}"


def check_fit(demands: list[Demand], nodes: list[Node]) -> dict[str, list[str]]:
    """Place `demands` on the `nodes`' totals; returns node address -> what went there. Raises
    `FitError` naming each actor that fits nowhere (and why), the totals asked for and offered, and the
    config keys to change."""
    room = {n.address: dict(n.resources) for n in nodes}
    placed: dict[str, list[str]] = {n.address: [] for n in nodes}
    problems: list[str] = []
    order = sorted(demands, key=lambda d: (-d.resources.get("GPU", 0.0), -d.resources.get("CPU", 0.0)))
    for d in order:
        labelled = [n for n in nodes if labels_match(d.labels, n.labels)]
        big_enough = [n for n in labelled if _fits(d.resources, n.resources)]
        where = f" on nodes labelled {d.labels}" if d.labels else ""
        if not labelled:
            problems.append(f"{d.what} needs node labels {d.labels}; no node has them")
            continue
        if not big_enough:
            best = max(labelled, key=lambda n: n.resources.get("CPU", 0.0))
            problems.append(
                f"{d.what} asks for {_fmt(d.resources)}; the largest node{where} ({best.address}) has "
                f"{_fmt(_only(best.resources, d))}"
            )
            continue
        free = [n for n in big_enough if _fits(d.resources, room[n.address])]
        if not free:
            problems.append(
                f"{d.what} asks for {_fmt(d.resources)}; once the actors before it are placed no node{where} "
                f"has that left ({', '.join(f'{n.address}: {_fmt(_only(room[n.address], d))}' for n in big_enough)})"
            )
            continue
        node = max(free, key=lambda n: (room[n.address].get("CPU", 0.0), room[n.address].get("GPU", 0.0)))
        for k, v in d.resources.items():
            room[node.address][k] = room[node.address].get(k, 0.0) - v
        placed[node.address].append(d.what)
    if problems:
        raise FitError(_report(problems, demands, nodes))
    return placed


def _report(problems: list[str], demands: list[Demand], nodes: list[Node]) -> str:
    asked: dict[str, float] = {}
    for d in demands:
        for k, v in d.resources.items():
            asked[k] = asked.get(k, 0.0) + v
    offered = {k: sum(n.resources.get(k, 0.0) for n in nodes) for k in asked}
    short = {k: asked[k] - offered[k] for k in asked if asked[k] > offered[k] + EPS}
    # an actor that found no room once the others were placed: any of them may give way
    crowded = any("once the actors before it are placed" in p for p in problems)
    named = {
        k for d in demands for k in d.keys if crowded or any(p.startswith(d.what + " ") for p in problems)
    }
    keys = sorted(named, key=lambda k: (".placement." in k, k))  # sizes first, then where things go
    per_node = ", ".join(f"{n.address} {_fmt({k: n.resources.get(k, 0.0) for k in COUNTED})}" for n in nodes)
    return (
        "the run does not fit the Ray cluster:\n  - "
        + "\n  - ".join(problems)
        + f"\nThe run asks for {_fmt(asked)} in all; the cluster's {len(nodes)} node(s) offer {_fmt(offered)}"
        + (f" (short by {_fmt(short)})" if short else "")
        + f": {per_node}.\nChange {', '.join(keys)}, or add nodes with more resources (`ray start "
        "--num-cpus/--num-gpus/--resources/--labels`; resources.num_cpus / num_gpus for a Ray Relax starts); "
        "docs/cluster.md"
    )


def check_cluster_fit(cfg: RelaxConfig, specs: list[Any], cluster_gpus: int) -> None:
    """`check_fit` of the run's demand on the connected Ray cluster's live nodes (`cluster_gpus`: the GPUs
    the run's GPU plan counted); raises `FitError`."""
    import ray

    nodes = [Node.from_ray(n) for n in ray.nodes() if n.get("Alive")]
    demands = run_demand(cfg, specs, cluster_gpus)
    placed = check_fit(demands, nodes)
    logger.info(
        "the run fits the cluster: %s",
        "; ".join(f"{addr}: {', '.join(w)}" for addr, w in placed.items() if w) or "nothing to place",
    )
    free = ray.available_resources()
    if any(free.get(k, 0.0) + EPS < sum(d.resources.get(k, 0.0) for d in demands) for k in COUNTED):
        logger.warning(
            "the run fits the cluster's totals but not what is free now (%s): other actors hold the rest, so "
            "roles may wait for them",
            _fmt({k: free.get(k, 0.0) for k in COUNTED}),
        )
