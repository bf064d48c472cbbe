"""The stage roles between the Rollout and the Actor in fully_async (ActorFwd, Reference, Advantages) as
the driver sees them: started from a step, asked for their failures, restarted in place from the step
in training, and ActorFwd's weight receiver, which sits in the weight-sync group beside the engines
(the `Receivers` of relax/orchestration/weight_push.py).

A restart in place goes through the `Redeploy` given at construction (the run's `Deployment`); which
roles to restart is the HealthManager's decision (`HealthManager.check`, `failed`).
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from relax.orchestration.interfaces import Redeploy
from relax.orchestration.weight_push import WeightGroup

logger = logging.getLogger(__name__)

STAGES = ("actor_fwd", "reference", "advantages")  # fully_async roles between Rollout and Actor
PROBE_TIMEOUT_S = 5.0  # a weight receiver's `/health` after a failed push


def answers(url: str) -> bool:
    """Whether a weight receiver's server answers `/health`."""
    try:
        return httpx.get(f"{url}/health", timeout=PROBE_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


class Stages:
    def __init__(
        self,
        handles: dict[str, Any],
        group: WeightGroup,
        redeploy: Redeploy | None = None,
        health: Any = None,
    ) -> None:
        """`handles`: the run's role handles (the stage roles among them are taken); `group`: the weight
        group ActorFwd's receiver joins; `health`: the HealthManager (None in unit tests)."""
        self.handles = {n: handles[n] for n in STAGES if n in handles}
        self.actor, self.group, self.deployment, self.health = handles["actor"], group, redeploy, health
        self.training_step = 0  # the step whose update is awaited (a restarted stage continues from it)
        if "actor_fwd" in self.handles:
            self.group.set_receivers([self.handles["actor_fwd"].weight_url.remote().result()])
            self.group.stale = False  # the driver forms the group with them at start

    def start(self, first_step: int) -> None:
        for handle in self.handles.values():
            handle.start.remote(first_step).result()

    def ask(self) -> list[Any]:
        """Ask every stage role for its failure now (a failed background loop raises from `metrics`)."""
        return [handle.metrics.remote(-1) for handle in self.handles.values()]

    def restart(self, names: list[str]) -> None:
        """Restart the roles `names` in place (the HealthManager counted them) and wait for their new
        heartbeats. A stage role continues from the step in training, or after the last step whose data
        the Actor already holds. A new ActorFwd has a new weight receiver: it joins the broadcast group
        at the next push; if it must first forward the step in training, the Actor (waiting for that
        step's data, so not updating) hands it the current weights once, through Ray."""
        for name in names:
            self._restart(name)
            if self.health is not None:
                self.health.restarted(name)

    def _restart(self, name: str) -> None:
        handle = self.deployment.redeploy(name)
        if name not in self.handles:
            return
        self.handles[name] = handle
        step = self.training_step
        # the Actor may already hold the step in training and the one after (fetched while it trains)
        first = max(step, self.actor.received_step.remote().result() + 1)
        if name == "actor_fwd":
            self.group.set_receivers([handle.weight_url.remote().result()])
            if first == step:
                handle.set_weights.remote(self.actor.state_dict.remote(), step - 1).result()
        handle.start.remote(first).result()
        logger.info("%s restarted; it continues from step %d", name, first)

    # -- the weight push's `Receivers` ----------------------------------------------------------
    def pushed(self, trained_step: int) -> None:
        if "actor_fwd" in self.handles:  # it received the same broadcast as the engines
            self.handles["actor_fwd"].mark_trained.remote(trained_step).result()

    def restart_dead(self) -> bool:
        """ActorFwd's weight receiver is in the push's group like an engine; one that does not answer
        `/health` broke the push. Its role is restarted now rather than when its heartbeat goes silent
        (`ops.heartbeat_timeout_s` later): a retry without it would fail the same way. The new replica's
        receiver joins the group for the retry."""
        if "actor_fwd" not in self.handles:
            return False
        for url in self.group.receivers:
            if not answers(url):
                self.health.failed("actor_fwd", f"its weight receiver at {url} does not answer")
                self.restart(["actor_fwd"])
                return True
        return False

    def stop(self) -> None:
        for name, handle in self.handles.items():
            try:
                handle.stop.remote().result(timeout_s=30)
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("stopping %s failed", name)
