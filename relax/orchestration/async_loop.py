"""The streaming side of the Controller's loop (hybrid, fully_async): starting the roles that run ahead,
the weight push that pauses or aborts generation around it, and waiting on the Actor while watching the
background roles for failures. In colocate mode the same calls reduce to a plain weight push.

Roles are Serve handles; this module only sequences calls, it computes nothing.
"""

from __future__ import annotations

import logging
from typing import Any

from relax.orchestration.registry import STREAMING_MODES

logger = logging.getLogger(__name__)

STAGES = ("actor_fwd", "reference", "advantages")  # fully_async roles between Rollout and Actor
POLL_S = 2.0  # how often a wait on the Actor checks the background roles


class StepFlow:
    def __init__(self, mode: str, handles: dict[str, Any]) -> None:
        self.streaming = mode in STREAMING_MODES
        self.rollout, self.actor = handles["rollout"], handles["actor"]
        self.stages = {n: handles[n] for n in STAGES if n in handles}
        # Weight receivers beside the engines: ActorFwd joins the trainer's broadcast group like an engine.
        self.receivers: list[str] = []
        if "actor_fwd" in self.stages:
            self.receivers.append(self.stages["actor_fwd"].weight_url.remote().result())

    def start(self, first_step: int) -> None:
        """Streaming modes: Rollout (gated by staleness) and the stage roles start from `first_step`."""
        if not self.streaming:
            return
        for handle in self.stages.values():
            handle.start.remote(first_step).result()
        self.rollout.start.remote(first_step).result()
        logger.info("streaming from step %d (%s)", first_step, ", ".join(["rollout", *self.stages]))

    def push_weights(self, trained_step: int) -> int:
        """Publish the weights trained through `trained_step` to the engines (and ActorFwd): the Rollout
        first waits for or aborts in-flight generation, then resumes and counts the step consumed."""
        self.rollout.begin_weight_update.remote().result()
        try:
            plan = self._apply_engine_changes()
            version = self.actor.push_weights.remote().result()
            if plan is not None:
                self.rollout.elastic_pushed.remote(version).result()
            if "actor_fwd" in self.stages:  # it received the same broadcast as the engines
                self.stages["actor_fwd"].mark_trained.remote(trained_step).result()
        finally:
            self.rollout.end_weight_update.remote(trained_step).result()
        return version

    def _apply_engine_changes(self) -> list[str] | None:
        """Elastic scaling: engines join or leave the weight-sync group here, where the trainer is
        idle; a group that cannot be formed with the joining engines is formed without them."""
        plan = self.rollout.elastic_plan.remote().result()
        if plan is None:
            return None
        try:
            self.actor.connect_engines.remote(plan + self.receivers).result()
        except Exception as e:  # noqa: BLE001 - the joining engines fail; training goes on without them
            logger.warning("weight-sync group with %s failed (%s); forming it without the new engines", plan, e)
            plan = self.rollout.elastic_join_failed.remote(str(e)).result()
            self.actor.connect_engines.remote(plan + self.receivers).result()
        self.rollout.elastic_group_formed.remote(plan).result()
        return plan

    def train(self, step: int) -> dict[str, float]:
        """The Actor's update on step `step`; while it waits for data, background failures surface."""
        response = self.actor.train.remote(step)
        if not self.streaming:
            return response.result()
        while True:
            try:
                metrics = response.result(timeout_s=POLL_S)
                break
            except TimeoutError:
                self.check()
        for handle in self.stages.values():
            metrics.update(handle.metrics.remote(step).result())
        return metrics

    def check(self) -> None:
        """Raise the failure of any background role."""
        self.rollout.check.remote().result()
        for handle in self.stages.values():
            handle.metrics.remote(-1).result()

    def stop(self) -> None:
        if not self.streaming:
            return
        for name, handle in [("rollout", self.rollout), *self.stages.items()]:
            try:
                handle.stop.remote().result(timeout_s=30)
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("stopping %s failed", name)
