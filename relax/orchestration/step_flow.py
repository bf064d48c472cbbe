"""The streaming side of the Controller's loop (hybrid, fully_async): starting the roles that run ahead,
the weight push that pauses or aborts generation around it, and waiting on the Actor while watching the
background roles for failures (through the HealthManager, which may restart a stage role in place; the
role then continues from the step in training). In colocate mode the same calls reduce to a plain
weight push.

Roles are Serve handles; this module only sequences calls, it computes nothing.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import httpx

from relax.config.modes import STREAMING_MODES

try:  # a replica that died mid-call; the HealthManager decides what that costs
    from ray.exceptions import RayActorError as ReplicaGone
except ImportError:  # pragma: no cover - Ray is a dependency
    ReplicaGone = RuntimeError

logger = logging.getLogger(__name__)

STAGES = ("actor_fwd", "reference", "advantages")  # fully_async roles between Rollout and Actor
POLL_S = 2.0  # how often a wait on the Actor checks the background roles
PROBE_TIMEOUT_S = 5.0  # a weight receiver's `/health` after a failed push


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=PROBE_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


class StepFlow:
    def __init__(self, mode: str, handles: dict[str, Any], health: Any = None) -> None:
        self.streaming = mode in STREAMING_MODES
        self.rollout, self.actor = handles["rollout"], handles["actor"]
        self.stages = {n: handles[n] for n in STAGES if n in handles}
        self.health = health  # HealthManager (None in unit tests)
        self.redeploy: Callable[[str], Any] | None = None  # name -> new handle (set by the Controller)
        self.training_step = 0  # the step whose update is awaited
        # Weight receivers beside the engines: ActorFwd joins the trainer's broadcast group like an engine.
        self.receivers: list[str] = []
        if "actor_fwd" in self.stages:
            self.receivers.append(self.stages["actor_fwd"].weight_url.remote().result())
        self._regroup = False  # a receiver changed (ActorFwd restarted): re-form the group at the next push
        self._finishing: Any = None  # the Rollout's `finish_weight_update` of the last push, not awaited
        self._preparing: Any = None  # the Rollout's `prepare_weight_update` sent by `begin_push`
        self._trained: int | None = None  # the step whose update ended since the last push began
        self._after: Callable[[], None] | None = None  # the post-train checks, asked not read
        self._checked_at = -math.inf  # when the background roles were last checked (monotonic)
        # overlap_push (relax/orchestration/registry.py): the next update is sent before the push, which
        # then sends the copy of the weights the Actor kept for the trained step
        self.overlap = False
        self._ahead: tuple[int, Any] | None = None  # (step, its `train` response) sent ahead
        self._pushing = 0  # the trained step whose weights the push in progress sends
        self.rollout_metrics: dict[str, float] = {}  # of the step last pushed (`begin_push`)

    def start(self, first_step: int) -> None:
        """Streaming modes: Rollout (gated by staleness) and the stage roles start from `first_step`."""
        if not self.streaming:
            return
        for handle in self.stages.values():
            handle.start.remote(first_step).result()
        self.rollout.start.remote(first_step).result()
        logger.info("streaming from step %d (%s)", first_step, ", ".join(["rollout", *self.stages]))

    def begin_push(self, trained_step: int, rollout_metrics: bool = False) -> None:
        """Send the first call of the push of `trained_step`'s weights (the Rollout's
        `prepare_weight_update`), then, after an update, the check that follows it (the heartbeats),
        which `push_weights` reads while the prepare runs. `rollout_metrics` (streaming modes): the prepare also brings the trained step's
        rollout metrics, read after the push from `self.rollout_metrics`.
        The Controller calls this as soon as the update ends, before anything else it sends then (the
        next update, under overlap_push): in fully_async the push is on the chain that sets the pace
        (docs/modes.md), and each Serve call sent before it delayed it by ~2-3 ms on 2 CPU cores."""
        self.settle()
        self._pushing = trained_step
        self._preparing = self.rollout.prepare_weight_update.remote(
            self.health is not None, trained_step if rollout_metrics else None
        )
        if self._trained is not None:  # the prepare raises the Rollout's failure
            self._after = self._ask_checks(rollout=False, stages=False)
            self._trained = None

    def push_weights(self, trained_step: int) -> int:
        """Publish the weights trained through `trained_step` to the engines (and ActorFwd): the Rollout
        first waits for or aborts in-flight generation, then resumes and counts the step consumed.
        Starts with `begin_push` unless the Controller already sent it.

        Three calls in the usual case: the Rollout's `prepare_weight_update` (stop generation, elastic
        plan, failed engines replaced), the Actor's push, and `finish_weight_update` (admit replaced
        engines, resume generation). The driver does not wait for the last: the next step's calls go
        out while the Rollout resumes (one round trip less on the critical path), and `settle()`, called
        before the next push and before anything that needs the Rollout's state, raises its error.
        The checks that `train` asked for after the update are read while the prepare runs, before the
        Actor's weights go out (an Actor replaced while it trained must not push fresh weights)."""
        if self._preparing is None or self._pushing != trained_step:
            self.begin_push(trained_step)
        preparing, self._preparing = self._preparing, None
        admit = False
        try:
            try:  # the trained step's checks were asked when it ended; they answer during the prepare
                self._read_after_train()
            finally:
                prep = preparing.result()
            self.rollout_metrics = prep.get("metrics", {})
            plan = self._apply_engine_changes(prep["plan"])
            if plan is None and self._regroup:
                urls = self.rollout.engine_urls.remote().result()
                self.actor.connect_engines.remote(urls + self.receivers).result()
            self._regroup = False
            version = self._push_to_live_engines(prep["replaced"])
            admit = self.health is not None
            if plan is not None:
                self.rollout.elastic_pushed.remote(version).result()
            if "actor_fwd" in self.stages:  # it received the same broadcast as the engines
                self.stages["actor_fwd"].mark_trained.remote(trained_step).result()
        finally:
            self._finishing = self.rollout.finish_weight_update.remote(trained_step, admit)
        return version

    def _actor_push(self) -> int:
        if self.overlap:  # the update after it may be running: the copy kept for the trained step
            return self.actor.push_weights.remote(self._pushing).result()
        return self.actor.push_weights.remote().result()

    def settle(self) -> None:
        """Wait for the last push's `finish_weight_update` (generation resumed, step counted consumed)."""
        finishing, self._finishing = self._finishing, None
        if finishing is not None:
            finishing.result()

    def _apply_engine_changes(self, plan: list[str] | None) -> list[str] | None:
        """Elastic scaling: engines join or leave the weight-sync group here, where the trainer is
        idle; a group that cannot be formed with the joining engines is formed without them."""
        if plan is None:
            return None
        try:
            self.actor.connect_engines.remote(plan + self.receivers).result()
        except Exception as e:  # noqa: BLE001 - the joining engines fail; training goes on without them
            logger.warning(
                "weight-sync group with %s failed (%s); forming it without the new engines", plan, e
            )
            plan = self.rollout.elastic_join_failed.remote(str(e)).result()
            self.actor.connect_engines.remote(plan + self.receivers).result()
        self.rollout.elastic_group_formed.remote(plan).result()
        return plan

    def _push_to_live_engines(self, replaced: dict | None) -> int:
        """The Actor's push; with a HealthManager, failed engines are replaced first (`replaced`: the
        Rollout's answer already fetched by `prepare_weight_update`), and a push that an engine's death
        breaks is retried once on the re-formed group. The replaced engines are admitted afterwards by
        `finish_weight_update`."""
        if self.health is None:
            return self._actor_push()
        self.health.engines_before_push(self.rollout, self.actor, self.receivers, replaced)
        try:
            return self._actor_push()
        except Exception:
            logger.exception("weight push failed; checking the engines and ActorFwd, then pushing again")
        self._restart_dead_receivers()
        # asks the Rollout again; a restarted ActorFwd's new receiver joins the group here
        self.health.engines_before_push(self.rollout, self.actor, self.receivers, regroup=self._regroup)
        self._regroup = False
        return self._actor_push()

    def _restart_dead_receivers(self) -> None:
        """ActorFwd's weight receiver is in the push's group like an engine; one that does not answer
        `/health` broke the push. Its role is restarted now rather than when its heartbeat goes silent
        (`ops.heartbeat_timeout_s` later): a retry without it would fail the same way. The new replica's
        receiver joins the group for the retry."""
        if "actor_fwd" not in self.stages:
            return
        for url in self.receivers:
            if not _answers(url):
                reason = f"its weight receiver at {url} does not answer"
                self.health.restart("actor_fwd", reason, self.restart_stage)
                return

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
        wait checks every `POLL_S`, as does the loop (`check(max_age_s=POLL_S)`). Each Serve round trip
        left out is ~3-4 ms of CPU a step on 2 cores."""
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
            self.receivers = [handle.weight_url.remote().result()]
            self._regroup = True
            if first == step:
                handle.set_weights.remote(self.actor.state_dict.remote(), step - 1).result()
        handle.start.remote(first).result()
        logger.info("%s restarted; it continues from step %d", name, first)

    def stop(self) -> None:
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
