"""The weight push and the one owner of its group (the sequence is drawn in docs/modes.md).

`WeightGroup` decides who receives the trainer's weights: the engines (those the Rollout serves, engines
the elastic API adds, replacements of failed ones) and the other receivers (ActorFwd's). Every change of
membership, at start-up, after an engine replacement, an elastic scale operation or a restarted ActorFwd,
goes through `reform`, which has the Actor form its weight-sync group with exactly those members.

`WeightPush` runs one push of a trained step's weights: three Serve calls in the usual case.

1. Rollout `prepare_weight_update`: raise the background rollout's failure, hand back the trained step's
   rollout metrics, stop or abort in-flight generation, the elastic plan (members to add or drop), and,
   with a HealthManager, failed engines replaced.
2. The group is re-formed where membership changed (`WeightGroup.reform`), then the Actor's
   `push_weights`; a push broken by a dead member is retried once on the re-formed group.
3. Rollout `finish_weight_update`: replaced engines take traffic again, generation resumes and the
   staleness gate counts the step consumed. The driver does not wait for it (`settle` does, before the
   next push or anything that needs the Rollout's state).

Roles are Serve handles; this module sequences calls and decides nothing about health (the HealthManager
answers whether engines changed). Its collaborators are given at construction: how a response is waited
for (`Wait`), and the receivers beside the engines (`Receivers`: ActorFwd's, relax/orchestration/stages.py).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from relax.orchestration.interfaces import PlainWait, Wait
from relax.utils import faults
from relax.utils.errors import cause_of

logger = logging.getLogger(__name__)


class Receivers(Protocol):
    """The weight receivers beside the engines, as the push sees them."""

    def pushed(self, trained_step: int) -> None:
        """The push of `trained_step`'s weights reached every receiver."""

    def restart_dead(self) -> bool:
        """After a failed push: restart the role of a receiver that does not answer; whether one was."""


class NoReceivers:
    """Only engines receive the weights."""

    def pushed(self, trained_step: int) -> None:
        return None

    def restart_dead(self) -> bool:
        return False


class WeightGroup:
    """Who receives the trainer's weights, and the one place that has the Actor re-form its group."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.engines: list[str] = []  # engine base URLs
        self.receivers: list[str] = []  # other weight receivers (ActorFwd's)
        self.formed: list[str] | None = None  # the members of the group as the Actor last formed it
        self.stale = False  # membership changed since it was formed: the next push re-forms it

    @property
    def members(self) -> list[str]:
        return [*self.engines, *self.receivers]

    def set_receivers(self, urls: list[str]) -> None:
        """Other receivers change (a restarted ActorFwd has a new one); the group re-forms at the next push."""
        self.receivers = list(urls)
        self.stale = True

    def reform(self, engines: list[str] | None = None) -> list[str]:
        """Form the Actor's weight-sync group with `engines` (default: the current ones) and the other
        receivers now; returns the members. A failure leaves the group marked unformed."""
        if engines is not None:
            self.engines = list(engines)
        members, self.formed, self.stale = self.members, None, True
        self.actor.connect_engines.remote(members).result()
        self.formed, self.stale = members, False
        logger.debug("weight-sync group formed with %s", members)
        return members


class WeightPush:
    """One push of the trained step's weights at a time; see the module docstring for the sequence."""

    def __init__(
        self,
        rollout: Any,
        actor: Any,
        group: WeightGroup,
        health: Any = None,
        *,
        receivers: Receivers | None = None,
        wait: Wait | None = None,
        overlap: bool = False,
    ) -> None:
        """`health`: the HealthManager (None: no engine is replaced, a failed push is not retried);
        `wait`: how a response is waited for (the run's Watchdog: deadlines while waiting); `overlap`:
        overlap_push, push the copy of the weights the Actor kept for the trained step."""
        self.rollout, self.actor, self.group, self.health = rollout, actor, group, health
        self.receivers = receivers if receivers is not None else NoReceivers()
        self.waiter = wait if wait is not None else PlainWait()
        self.overlap = overlap
        self.rollout_metrics: dict[str, float] = {}  # of the step last pushed (asked by `begin`)
        self._preparing: Any = None  # the Rollout's `prepare_weight_update`, sent by `begin`
        self._finishing: Any = None  # the Rollout's `finish_weight_update` of the last push
        self._pushing = 0  # the trained step whose weights the push in progress sends
        self.version: int | None = None  # the weight version the receivers hold (of the last push)
        # one push or repair at a time (`repair` runs on another thread); the step flow holds it over the
        # post-train checks it reads before `push`, so a repair never runs between them
        self.lock = threading.RLock()

    def begin(self, trained_step: int, rollout_metrics: bool = False) -> None:
        """Send the push's first call (the Rollout's `prepare_weight_update`) now: in fully_async the push
        is on the chain that sets the pace, so it goes out before anything else the driver sends then.
        `rollout_metrics` (streaming modes): the prepare also brings the trained step's rollout metrics."""
        self.settle()
        self._pushing = trained_step
        self._preparing = self.rollout.prepare_weight_update.remote(
            self.health is not None, trained_step if rollout_metrics else None
        )

    def wait(self, response: Any, role: str, phase: str) -> Any:
        return self.waiter.wait(response, role, phase)

    def push(self, trained_step: int) -> int:
        """Publish the weights trained through `trained_step`; returns the version the receivers hold."""
        if self._preparing is None or self._pushing != trained_step:
            self.begin(trained_step)
        with self.lock:
            return self._push(trained_step)

    def cancel(self, trained_step: int) -> None:
        """The push begun for `trained_step` does not happen (a check before it failed): the prepare is
        waited for (generation stopped), then generation resumes without new weights."""
        preparing, self._preparing = self._preparing, None
        try:
            if preparing is not None:
                self.wait(preparing, "rollout", "stopping generation for the weight push")
        finally:
            self._finishing = self.rollout.finish_weight_update.remote(trained_step, False, None)

    def _push(self, trained_step: int) -> int:
        preparing, self._preparing = self._preparing, None
        admit, version = False, None
        try:
            prep = self.wait(preparing, "rollout", "stopping generation for the weight push")
            self.rollout_metrics = prep.get("metrics", {})
            plan = self._apply_elastic_plan(prep["plan"])
            if plan is None:
                self._regroup(prep["replaced"])
            version = self.version = self._push_with_retry()
            admit = self.health is not None
            if plan is not None:
                self.rollout.elastic_pushed.remote(version).result()
            self.receivers.pushed(trained_step)
        finally:
            self._finishing = self.rollout.finish_weight_update.remote(trained_step, admit, version)
        return version

    def repair(self) -> None:
        """Between pushes: give replacement engines the weights the others hold, so that requests waiting
        for them (no engine left to serve) go on. Called from the HealthManager's engine watch thread;
        the Actor sends the copy of the weights it kept for that version (overlap_push), else its current
        weights, which are that version's while no update runs (colocate: the rollout or evaluation
        waits; the streaming modes: the update waits for the rollout's data)."""
        with self.lock:
            info = self.rollout.replace_dead_engines.remote().result()
            if not info.get("pending"):
                return  # the last push took them in
            self.health.engines_replaced(info)
            self.group.reform(info["urls"])
            version = self.actor.push_weights.remote(self.version).result()
            admitted = self.rollout.admit_engines.remote().result()
            logger.info("replacement engines %s hold weights v%s and take requests", admitted, version)

    def settle(self) -> None:
        """Wait for the last push's `finish_weight_update` (generation resumed, step counted consumed)."""
        finishing, self._finishing = self._finishing, None
        if finishing is not None:
            self.wait(finishing, "rollout", "resuming generation after the weight push")

    def _actor_push(self) -> int:
        faults.point("weight_push.push")
        if self.overlap:  # the update after it may be running: the copy kept for the trained step
            return self.wait(self.actor.push_weights.remote(self._pushing), "actor", "the weight push")
        return self.wait(self.actor.push_weights.remote(), "actor", "the weight push")

    def _apply_elastic_plan(self, plan: list[str] | None) -> list[str] | None:
        """Elastic scaling: engines join or leave here, where the trainer is idle; a group that cannot be
        formed with the joining engines is formed without them (they fail, training goes on)."""
        if plan is None:
            return None
        try:
            self.group.reform(plan)
        except Exception as e:  # noqa: BLE001 - the joining engines fail; training goes on without them
            logger.warning(
                "weight-sync group with %s failed (%s); forming it without the new engines", plan, e
            )
            plan = self.rollout.elastic_join_failed.remote(cause_of(e)).result()
            self.group.reform(plan)
        self.rollout.elastic_group_formed.remote(plan).result()
        return plan

    def _regroup(self, replaced: dict | None) -> None:
        """Re-form the group where failed engines were replaced (the Rollout's `replace_dead_engines`
        answer, fetched by the prepare, or asked now when None and a HealthManager watches) or another
        receiver changed; the engines are then the ones the Rollout names now. The HealthManager counts
        the replacements and says whether they change the group."""
        if self.health is not None and replaced is None:
            replaced = self.rollout.replace_dead_engines.remote().result()
        changed = self.health is not None and self.health.engines_replaced(replaced)
        # pending replacements the group lacks (a repair that failed after counting them) join it too
        pending = replaced.get("pending", []) if replaced is not None else []
        changed = changed or any(u not in self.group.engines for u in pending)
        if changed or self.group.stale:
            urls = replaced["urls"] if replaced is not None else self.rollout.engine_urls.remote().result()
            self.group.reform(urls)

    def _push_with_retry(self) -> int:
        """The Actor's push; with a HealthManager a push that a member's death breaks is retried once,
        after the dead members are replaced (engines by the Rollout, a receiver's role in place)."""
        if self.health is None:
            return self._actor_push()
        try:
            return self._actor_push()
        except Exception:
            logger.exception("weight push failed; checking the engines and receivers, then pushing again")
        self.receivers.restart_dead()
        self._regroup(None)
        return self._actor_push()
