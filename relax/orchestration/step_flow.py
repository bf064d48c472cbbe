"""The Controller's step sequencing: starting the roles that run ahead (hybrid, fully_async), the weight
push of each trained step (`relax.orchestration.weight_push`), and waiting on the Actor while watching
the background roles for failures (the HealthManager decides which roles restart in place; `Stages`,
relax/orchestration/stages.py, restarts them, and a stage role continues from the step in training). In
colocate mode the same calls reduce to an update and a plain weight push.

Roles are Serve handles; this module only sequences calls, it computes nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from relax.config.modes import STREAMING_MODES
from relax.orchestration.interfaces import PlainWait, Redeploy, Wait, Watch
from relax.orchestration.stages import Stages
from relax.orchestration.weight_push import WeightGroup, WeightPush

try:  # a replica that died mid-call; the HealthManager decides what that costs
    from ray.exceptions import RayActorError as ReplicaGone
except ImportError:  # pragma: no cover - Ray is a dependency
    ReplicaGone = RuntimeError

logger = logging.getLogger(__name__)

POLL_S = 2.0  # how often a wait on the Actor checks the background roles


class StepFlow:
    def __init__(
        self,
        mode: str,
        handles: dict[str, Any],
        health: Any = None,
        *,
        redeploy: Redeploy | None = None,
        wait: Wait | None = None,
        watch: Watch | None = None,
        overlap: bool = False,
    ) -> None:
        """`handles`: the run's role handles; `health`: the HealthManager (None in unit tests); `redeploy`:
        restarts a role in place (the run's `Deployment`); `wait`, `watch`: how the driver waits on a role
        and watches the time meanwhile (the run's Watchdog; no deadlines when None); `overlap`:
        overlap_push (relax/config/modes.py), the next update is sent before the push, which then sends
        the copy of the weights the Actor kept for the trained step."""
        self.streaming = mode in STREAMING_MODES
        self.rollout, self.actor = handles["rollout"], handles["actor"]
        self.health = health
        self.watch = watch if watch is not None else PlainWait()
        # Who receives the weights: the engines and, beside them, ActorFwd's receiver (it joins the
        # trainer's broadcast group like an engine).
        self.group = WeightGroup(self.actor)
        self.stages = Stages(handles, self.group, redeploy, health)
        self.weights = WeightPush(
            self.rollout, self.actor, self.group, health, receivers=self.stages, wait=wait, overlap=overlap
        )
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
        return self.weights.overlap

    @property
    def training_step(self) -> int:
        """The step whose update is awaited."""
        return self.stages.training_step

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
        self.stages.start(first_step)
        self.rollout.start.remote(first_step).result()
        logger.info("streaming from step %d (%s)", first_step, ", ".join(["rollout", *self.stages.handles]))

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
        while it trained must not push fresh weights; a failed check cancels the push). Returns the
        version the receivers hold."""
        if self._trained is not None:
            self.begin_push(trained_step)
        with self.weights.lock:
            after, self._after = self._after, None
            try:
                if after is not None:
                    after()
            except BaseException:
                self.weights.cancel(trained_step)
                raise
            return self.weights.push(trained_step)

    def settle(self) -> None:
        """Wait for the last push's `finish_weight_update` (generation resumed, step counted consumed)."""
        self.weights.settle()

    def train(self, step: int) -> dict[str, float]:
        """The Actor's update on step `step`; while it waits for data, background failures surface.
        The checks that follow an update go out with the push (`begin_push`). Advantages' metrics of the
        step come with the Actor's (through the data plane)."""
        self.stages.training_step = step
        ahead, self._ahead = self._ahead, None
        response = ahead[1] if ahead is not None and ahead[0] == step else self.actor.train.remote(step)
        try:
            while True:
                try:
                    metrics = response.result(timeout_s=POLL_S)
                    break
                except TimeoutError:
                    self.check()
                    self.watch.check("actor", "the update")
        except BaseException:
            response.cancel()  # never delivered later, to the replica of a restarted Actor (watchdog.py)
            raise
        self._trained = step
        return metrics

    def train_ahead(self, step: int) -> None:
        """overlap_push: send step `step`'s update now, before the push of the step before; `train(step)`
        then waits for this one. It is the step in training from now on (a stage role restarted during
        the push continues from it)."""
        self._ahead = (step, self.actor.train.remote(step))
        self.stages.training_step = step

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

        responses = self.stages.ask() if stages else []

        def read() -> None:
            nonlocal responses
            if self.health is not None:
                failed = self.health.check(asked)
                self.stages.restart(failed)
                if failed and stages:  # asked again, on the new handles
                    responses = self.stages.ask()
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

    def check(self, max_age_s: float = 0.0) -> None:
        """Let the HealthManager restart failed stage roles; raise the failure of any background role.
        Asked together: one round trip instead of one per role. `max_age_s`: skip when the roles were
        checked less than this long ago."""
        if time.monotonic() - self._checked_at < max_age_s:
            return
        self._ask_checks()()

    def stop(self) -> None:
        if self.health is not None:
            self.health.unwatch_engines()
        try:
            self.settle()
        except Exception:  # noqa: BLE001 - best effort on the way out; the push's error was logged
            logger.exception("the last weight update did not finish")
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[1].cancel()
        if not self.streaming:
            return
        try:
            self.rollout.stop.remote().result(timeout_s=30)
        except Exception:  # noqa: BLE001 - best effort on the way out
            logger.exception("stopping rollout failed")
        self.stages.stop()
