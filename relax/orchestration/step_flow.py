"""The Controller's step sequencing: starting the roles that run ahead (hybrid, fully_async), the weight
push of each trained step (`relax.orchestration.weight_push`), and waiting on the Actor while watching
the background roles for failures (through the HealthManager, which may restart a stage role in place;
the role then continues from the step in training). In colocate mode the same calls reduce to an update
and a plain weight push.

Roles are Serve handles; this module only sequences calls, it computes nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from relax.config.modes import STREAMING_MODES
from relax.orchestration.weight_push import WeightGroup, WeightPush, answers

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
        # Who receives the weights: the engines and, beside them, ActorFwd's receiver (it joins the
        # trainer's broadcast group like an engine).
        self.group = WeightGroup(self.actor)
        if "actor_fwd" in self.stages:
            self.group.set_receivers([self.stages["actor_fwd"].weight_url.remote().result()])
            self.group.stale = False  # the Controller forms the group with them at start
        self.weights = WeightPush(self.rollout, self.actor, self.group, health)
        self.weights.after_prepare = self._read_after_train
        self.weights.dead_receiver = self._restart_dead_receivers
        self.weights.pushed = self._pushed
        # deadlines while the driver waits (the Controller's watchdog); nothing in unit tests
        self.watch: Callable[[str, str], None] = lambda role, phase: None
        self._trained: int | None = None  # the step whose update ended since the last push began
        self._after: Callable[[], None] | None = None  # the post-train checks, asked not read
        self._checked_at = -math.inf  # when the background roles were last checked (monotonic)
        self._ahead: tuple[int, Any] | None = None  # (step, its `train` response) sent ahead

    @property
    def receivers(self) -> list[str]:
        """Weight receivers beside the engines (ActorFwd's)."""
        return self.group.receivers

    @property
    def overlap(self) -> bool:
        """overlap_push (relax/config/modes.py): the next update is sent before the push, which then sends
        the copy of the weights the Actor kept for the trained step."""
        return self.weights.overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self.weights.overlap = value

    @property
    def rollout_metrics(self) -> dict[str, float]:
        """The rollout metrics of the step last pushed (streaming modes, asked by `begin_push`)."""
        return self.weights.rollout_metrics

    def start(self, first_step: int) -> None:
        """Streaming modes: Rollout (gated by staleness) and the stage roles start from `first_step`.
        Every mode: the HealthManager's engine watch starts (requests waiting for replacement engines)."""
        if self.health is not None:
            self.health.watch_engines(self.weights.repair)
        if not self.streaming:
            return
        for handle in self.stages.values():
            handle.start.remote(first_step).result()
        self.rollout.start.remote(first_step).result()
        logger.info("streaming from step %d (%s)", first_step, ", ".join(["rollout", *self.stages]))

    def begin_push(self, trained_step: int, rollout_metrics: bool = False) -> None:
        """Send the push's first call now (`WeightPush.begin`), then, after an update, the check that
        follows it (the heartbeats), which the push reads while the prepare runs. The Controller calls
        this as soon as the update ends, before anything else it sends then (the next update, under
        overlap_push): in fully_async the push is on the chain that sets the pace (docs/modes.md)."""
        self.weights.begin(trained_step, rollout_metrics)
        if self._trained is not None:  # the prepare raises the Rollout's failure
            self._after = self._ask_checks(rollout=False, stages=False)
            self._trained = None

    def push_weights(self, trained_step: int) -> int:
        """Publish the weights trained through `trained_step` (`WeightPush.push`); the checks asked after
        the update are read while the prepare runs, before the Actor's weights go out (an Actor replaced
        while it trained must not push fresh weights). Returns the version the receivers hold."""
        if self._trained is not None:
            self.begin_push(trained_step)
        return self.weights.push(trained_step)

    def settle(self) -> None:
        """Wait for the last push's `finish_weight_update` (generation resumed, step counted consumed)."""
        self.weights.settle()

    def _pushed(self, trained_step: int) -> None:
        if "actor_fwd" in self.stages:  # it received the same broadcast as the engines
            self.stages["actor_fwd"].mark_trained.remote(trained_step).result()

    def _restart_dead_receivers(self) -> bool:
        """ActorFwd's weight receiver is in the push's group like an engine; one that does not answer
        `/health` broke the push. Its role is restarted now rather than when its heartbeat goes silent
        (`ops.heartbeat_timeout_s` later): a retry without it would fail the same way. The new replica's
        receiver joins the group for the retry."""
        if "actor_fwd" not in self.stages:
            return False
        for url in self.receivers:
            if not answers(url):
                reason = f"its weight receiver at {url} does not answer"
                self.health.restart("actor_fwd", reason, self.restart_stage)
                return True
        return False

    def train(self, step: int) -> dict[str, float]:
        """The Actor's update on step `step`; while it waits for data, background failures surface.
        The checks that follow an update go out with the push (`begin_push`). Advantages' metrics of the
        step come with the Actor's (through the data plane)."""
        self.training_step = step
        ahead, self._ahead = self._ahead, None
        response = ahead[1] if ahead is not None and ahead[0] == step else self.actor.train.remote(step)
        while True:
            try:
                metrics = response.result(timeout_s=POLL_S)
                break
            except TimeoutError:
                self.check()
                self.watch("actor", "the update")
        self._trained = step
        return metrics

    def train_ahead(self, step: int) -> None:
        """overlap_push: send step `step`'s update now, before the push of the step before; `train(step)`
        then waits for this one. It is the step in training from now on (a stage role restarted during
        the push continues from it)."""
        self._ahead = (step, self.actor.train.remote(step))
        self.training_step = step

    @property
    def training_ahead(self) -> bool:
        return self._ahead is not None

    def _ask_checks(self, rollout: bool = True, stages: bool = True) -> Callable[[], None]:
        """Send the background checks now; the returned function reads them, raising a failure. The
        heartbeats are read first: when the HealthManager restarts a stage role, the stage roles are
        asked again, on the new handles.
        After an update only the heartbeats are asked (`begin_push`): `prepare_weight_update`, sent
        first, raises the Rollout's failure, and a stage role's failure stops the Actor's next step, whose
        wait checks every `POLL_S`, as does the loop (`check(max_age_s=POLL_S)`). A Serve round trip
        left out is CPU a step saved (docs/measurements.md)."""
        asked = self.health.ask() if self.health is not None else None
        rollout = self.rollout.check.remote() if self.streaming and rollout else None
        stages = stages and self.streaming

        def ask_stages() -> list:
            return [handle.metrics.remote(-1) for handle in self.stages.values()] if stages else []

        responses = ask_stages()

        def read() -> None:
            nonlocal responses
            if self.health is not None:
                restarts = sum(self.health.role_restarts.values())
                self.health.check(self.restart_stage, asked)
                if sum(self.health.role_restarts.values()) != restarts:
                    responses = ask_stages()
            if rollout is not None:
                rollout.result()
            for response in responses:
                try:
                    response.result()
                except ReplicaGone:
                    if self.health is None:
                        raise  # without a HealthManager nobody would restart it
            if stages or not self.streaming:
                self._checked_at = time.monotonic()

        return read

    def _read_after_train(self) -> None:
        after, self._after = self._after, None
        if after is not None:
            after()

    def check(self, max_age_s: float = 0.0) -> None:
        """Let the HealthManager restart failed stage roles; raise the failure of any background role.
        Asked together: one round trip instead of one per role. `max_age_s`: skip when the roles were
        checked less than this long ago."""
        if time.monotonic() - self._checked_at < max_age_s:
            return
        self._ask_checks()()

    def restart_stage(self, name: str) -> None:
        """Redeploy role `name`; a stage role continues from the step in training, or after the last step
        whose data the Actor already holds. A new ActorFwd has a new weight receiver: it joins the
        broadcast group at the next push; if it must first forward the step in training, the Actor (waiting
        for that step's data, so not updating) hands it the current weights once, through Ray."""
        handle = self.redeploy(name)
        if name not in self.stages:
            return
        self.stages[name] = handle
        step = self.training_step
        # the Actor may already hold the step in training and the one after (fetched while it trains)
        first = max(step, self.actor.received_step.remote().result() + 1)
        if name == "actor_fwd":
            self.group.set_receivers([handle.weight_url.remote().result()])
            if first == step:
                handle.set_weights.remote(self.actor.state_dict.remote(), step - 1).result()
        handle.start.remote(first).result()
        logger.info("%s restarted; it continues from step %d", name, first)

    def stop(self) -> None:
        if self.health is not None:
            self.health.unwatch_engines()
        try:
            self.settle()
        except Exception:  # noqa: BLE001 - best effort on the way out; the push's error was logged
            logger.exception("the last weight update did not finish")
        if not self.streaming:
            return
        for name, handle in [("rollout", self.rollout), *self.stages.items()]:
            try:
                handle.stop.remote().result(timeout_s=30)
            except Exception:  # noqa: BLE001 - best effort on the way out
                logger.exception("stopping %s failed", name)
