"""Ray placement helpers shared by the actor groups (training ranks, engines): put an actor in a named
placement group's bundle, and wait for a group to be placed with a clear message while it is not."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

PLACEMENT_WARN_S = 30.0  # a placement group still pending this long is reported, again at each interval
PLACEMENT_TIMEOUT_S = 300.0


def wait_for_placement(pg: Any, what: str) -> None:
    """Wait until the placement group `pg` is placed. While it is not, say every `PLACEMENT_WARN_S` what
    it waits for and what the cluster has free (the roles of a mode, its engines and the training ranks
    may ask for more than the cluster has); after `PLACEMENT_TIMEOUT_S`, remove it and raise with the keys
    that change the demand or the supply. An autoscaling cluster may still add nodes in the meantime."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import remove_placement_group

    waited = 0.0
    while True:
        try:
            ray.get(pg.ready(), timeout=PLACEMENT_WARN_S)
            return
        except GetTimeoutError:
            waited += PLACEMENT_WARN_S
        free, total = ray.available_resources(), ray.cluster_resources()
        have = ", ".join(
            f"{k} {free.get(k, 0):g} of {total.get(k, 0):g}" for k in ("CPU", "GPU") if k in total
        )
        msg = (
            f"{what} not placed after {waited:.0f} s; free now: {have or 'nothing'}. The other roles, engines "
            "and reward workers hold the rest: raise resources.num_cpus (a Ray that Relax starts) or the "
            "cluster's size, or lower trainer.num_ranks / trainer.cpus_per_rank"
        )
        if waited >= PLACEMENT_TIMEOUT_S:
            remove_placement_group(pg)
            raise RuntimeError(msg)
        logger.warning(msg)


def bundle_options(group: str | None, index: int) -> dict:
    """Ray `.options(...)` that put an actor in bundle `index` (mod bundles) of the named group, or {}."""
    if not group:
        return {}
    from ray.util import get_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = get_placement_group(group)
    idx = index % len(pg.bundle_specs)
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=idx)}


def ray_placement(cfg: Any, key: str) -> dict[str, Any]:
    """Ray `.options(...)` (and Serve `ray_actor_options`) for `resources.placement.<key>`: the custom
    resources and node label selector the user gave that role or actor group, or {} (anywhere)."""
    p = cfg.resources.placement.get(key)
    if p is None:
        return {}
    out: dict[str, Any] = {}
    if p.resources:
        out["resources"] = dict(p.resources)
    if p.label_selector:
        out["label_selector"] = dict(p.label_selector)
    return out
