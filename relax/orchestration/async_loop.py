"""The streaming side of the Controller's loop (hybrid, fully_async): starting the roles that run ahead,
the weight push that pauses or aborts generation around it, and waiting on the Actor while watching the
background roles for failures (through the HealthManager, which may restart a stage role in place; the
role then continues from the step in training). In colocate mode the same calls reduce to a plain
weight push.

Roles are Serve handles; this module only sequences calls, it computes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from relax.orchestration.registry import STREAMING_MODES

try:  # a replica that died mid-call; the HealthManager decides what that costs
    from ray.exceptions import RayActorError as ReplicaGone
except ImportError:  # pragma: no cover - Ray is a dependency
    ReplicaGone = RuntimeError

logger = logging.getLogger(__name__)

STAGES = ("actor_fwd", "reference", "advantages")  # fully_async roles between Rollout and Actor
POLL_S = 2.0  # how often a wait on the Actor checks the background roles


class StepFlow:
    def __init__(self, mode: str, handles: dict[str, Any], health: Any = None) -> None:
        self.streaming = mode in STREAMING_MODES
        self.rollout, self.actor = handles["rollout"], handles["actor"]
        self.stages = {n: handles[n] for n in STAGES if n in handles}
        self.health = health  # HealthManager (None in unit tests)
        self.redeploy: Callable[[str], Any] | None = None  # name -> new handle (set by the Controller)
        self.training_step = 0  # the step whose update is awaited
        self.pushed: tuple[Any, int] | None = None  # (ActorFwd weights, training step) of the last push

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
            version = self._push_to_live_engines()
            if "actor_fwd" in self.stages:
                self.pushed = (self.actor.state_dict.remote(), trained_step)
                self.stages["actor_fwd"].set_weights.remote(*self.pushed).result()
        finally:
            self.rollout.end_weight_update.remote(trained_step).result()
        return version

    def _push_to_live_engines(self) -> int:
        """The Actor's push; with a HealthManager, failed engines are replaced first, and a push that an
        engine's death breaks is retried once on the re-formed group."""
        if self.health is None:
            return self.actor.push_weights.remote().result()
        for attempt in (1, 2):
            self.health.engines_before_push(self.rollout, self.actor)
            try:
                version = self.actor.push_weights.remote().result()
                break
            except Exception:
                if attempt == 2:
                    raise
                logger.exception("weight push failed; checking the engines and pushing again")
        self.health.engines_after_push(self.rollout)
        return version

    def train(self, step: int) -> dict[str, float]:
        """The Actor's update on step `step`; while it waits for data, background failures surface."""
        self.training_step = step
        response = self.actor.train.remote(step)
        while True:
            try:
                metrics = response.result(timeout_s=POLL_S)
                break
            except TimeoutError:
                self.check()
        self.check()  # an Actor replaced while it trained answered from fresh state: not a result
        for handle in self.stages.values():
            metrics.update(handle.metrics.remote(step).result())
        return metrics

    def check(self) -> None:
        """Let the HealthManager restart failed stage roles; raise the failure of any background role."""
        if self.health is not None:
            self.health.check(self.restart_stage)
        if not self.streaming:
            return
        self.rollout.check.remote().result()
        for handle in self.stages.values():
            try:
                handle.metrics.remote(-1).result()
            except ReplicaGone:
                if self.health is None:
                    raise  # without a HealthManager nobody would restart it

    def restart_stage(self, name: str) -> None:
        """Redeploy role `name`; a stage role continues from the step in training (or the next one when
        the Actor already holds that step's data), ActorFwd with the last pushed weights."""
        handle = self.redeploy(name)
        if name not in self.stages:
            return
        self.stages[name] = handle
        step = self.training_step
        first = step if self.actor.received_step.remote().result() < step else step + 1
        if name == "actor_fwd" and self.pushed is not None:
            handle.set_weights.remote(*self.pushed).result()
        handle.start.remote(first).result()
        logger.info("%s restarted; it continues from step %d", name, first)

    def stop(self) -> None:
        if not self.streaming:
            return
        for name, handle in [("rollout", self.rollout), *self.stages.items()]:
            try:
                handle.stop.remote().result(timeout_s=30)
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("stopping %s failed", name)
