"""The HealthManager: reads the services' heartbeats (`relax.ops.heartbeat`) and decides what a failure
costs.

* A **stateless** role (ActorFwd, Reference, Advantages, GenRM, Metrics) that died, was replaced behind
  our back (a new incarnation: its state is gone) or went silent for `ops.heartbeat_timeout_s` is
  restarted in place: its Serve application is deleted and deployed again, and `Stages`
  (relax/orchestration/stages.py) hands it the step to continue from (and ActorFwd the last pushed
  weights). The HealthManager decides and counts (`check`, `failed`); the caller restarts. Rows it had
  taken but not finished are taken again by the new replica, which is a new data-plane consumer;
  recomputed columns are identical.
* A beat late by more than two heartbeat intervals is not yet a failure, but the board then pings the
  sender's actor, and a role that Ray reports dead has failed at once (relax/ops/heartbeat.py): a killed
  role is found within seconds, not after `ops.heartbeat_timeout_s`, and before Serve has started a
  replacement replica that would only be thrown away.
* The **Actor** and the **Rollout** hold state that only a checkpoint restores (weights and optimizer;
  data position and staleness gate): their failure, or a stateless role failing more than
  `ops.max_role_restarts` times, raises `GlobalRestart`, which `relax.orchestration.recovery` turns into a
  restart of every role from the last checkpoint.
* **Inference engines** are checked before every weight push: the Rollout replaces failed ones, and
  `engines_replaced` tells the push (`relax.orchestration.weight_push`) to re-form the weight-sync group
  with the survivors and replacements, so a push never waits on a dead engine; replacements take
  requests only after the push (the Rollout's `finish_weight_update`). An engine whose actor died is
  replaced by the Rollout at once; when requests wait because no engine is left to serve them (the
  `engines` beat), `watch_engines` has the driver push the current weights to the replacements without
  waiting for the next step (`WeightPush.repair`). The HealthManager decides and counts; it never calls
  the Actor.

Counts of restarts are reported to the Metrics service as `health/*`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from relax.config import RelaxConfig
from relax.ops.heartbeat import create_board
from relax.ops.notify import Notifier

logger = logging.getLogger(__name__)

STATELESS = {"actor_fwd", "reference", "advantages", "genrm", "metrics"}
WATCH_TIMEOUT_S = 120.0


class GlobalRestart(RuntimeError):
    """A failure that only a restart of every role from the last checkpoint repairs."""

    def __init__(self, role: str, reason: str) -> None:
        super().__init__(f"role {role!r}: {reason}")
        self.role, self.reason = role, reason

    def __reduce__(self) -> tuple:  # Ray sends it between processes: rebuilt from its fields, not its text
        return type(self), (self.role, self.reason)


class HealthManager:
    def __init__(self, cfg: RelaxConfig, notifier: Notifier) -> None:
        self.ops = cfg.ops
        self.notifier = notifier
        self.board = create_board()
        self.known: dict[str, str] = {}  # role -> incarnation of the replica we initialised
        self.role_restarts: dict[str, int] = {}
        self.engine_restarts = 0
        self._engine_watch: threading.Event | None = None  # set: the engine watch of this attempt ends

    @property
    def late_s(self) -> float:
        """A beat this late (two intervals missed) has the board ask Ray whether its sender is alive."""
        return 2 * self.ops.heartbeat_interval_s

    def ask(self, probe_after_s: float | None = None) -> Any:
        """Ask the board for its snapshot now; hand the answer to `check` later, so the round trip
        overlaps the caller's other calls. Senders silent for `probe_after_s` (default `late_s`) are
        pinged first."""
        return self.board.snapshot.remote(self.late_s if probe_after_s is None else probe_after_s)

    def _snapshot(self, asked: Any = None) -> dict[str, dict[str, Any]]:
        import ray

        return ray.get(self.ask() if asked is None else asked, timeout=60)

    def watch(
        self, names: list[str], timeout_s: float = WATCH_TIMEOUT_S, *, replacing: str | None = None
    ) -> None:
        """Wait until each role in `names` has beaten (for `replacing`: with a new incarnation); from
        now on a change of incarnation or silence is a failure."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self._snapshot()
            ready = {
                n: snap[n]["incarnation"]
                for n in names
                if n in snap and (n != replacing or snap[n]["incarnation"] != self.known.get(n))
            }
            if len(ready) == len(names):
                self.known.update(ready)
                return
            if time.monotonic() > deadline:
                missing = sorted(set(names) - set(ready))
                raise GlobalRestart(
                    missing[0], f"no heartbeat within {timeout_s:.0f}s of its start ({missing})"
                )
            time.sleep(0.2)

    def failures(self, asked: Any = None) -> dict[str, str]:
        """role -> what is wrong with it, for every watched role that is not well (`asked`: a snapshot
        from `ask()`)."""
        snap = self._snapshot(asked)
        bad = {}
        for name, incarnation in self.known.items():
            beat = snap.get(name)
            if beat is None:
                bad[name] = "its heartbeat is gone"
            elif beat["incarnation"] != incarnation:
                bad[name] = "its replica was replaced and lost its state"
            elif beat.get("dead"):
                bad[name] = f"its process died (pid {beat['pid']}; Ray reports its actor dead)"
            elif beat["age_s"] > self.ops.heartbeat_timeout_s:
                bad[name] = (
                    f"silent for {beat['age_s']:.0f}s (ops.heartbeat_timeout_s={self.ops.heartbeat_timeout_s:g})"
                )
        return bad

    def failure_behind(self, error: Exception) -> GlobalRestart | None:
        """The role failure that explains `error`, raised by a call to a role, if the board shows one: a
        call that reached the replica Serve put in place of a dead one fails on the state the new
        replica lacks (weights never connected, a step it never received) before the heartbeats are
        checked again. Such an error is the replaced role's failure, and restartable; any other error is
        the caller's to raise."""
        if isinstance(error, GlobalRestart) or not self.known:
            return None
        try:
            bad = self.failures(self.ask(probe_after_s=0.0))  # a call failed: ask after every role now
        except Exception:  # noqa: BLE001 - the board does not answer: the error stands as it is
            logger.exception("reading the heartbeats after %s failed", type(error).__name__)
            return None
        if not bad:
            return None
        name = min(bad, key=lambda n: n in STATELESS)  # a role with training state first
        reason = bad[name]
        return GlobalRestart(name, f"{reason}; a call failed meanwhile: {type(error).__name__}: {error}")

    def check_state(self) -> None:
        """Raise `GlobalRestart` when a role that holds training state (the Actor, the Rollout) died or
        was replaced. The driver's waits call this between their slices (`Watchdog`): a call to a dead
        replica is queued by Serve until a replacement starts, and that replacement lacks the state."""
        if not self.known:
            return
        try:
            bad = self.failures()
        except Exception:  # noqa: BLE001 - the board does not answer: the wait goes on under its deadlines
            logger.warning("reading the heartbeats during a wait failed", exc_info=True)
            return
        for name, reason in bad.items():
            if name not in STATELESS:
                raise GlobalRestart(name, reason)

    def check(self, asked: Any = None) -> list[str]:
        """The failed stateless roles to restart in place now, each counted (`failed`); raises
        `GlobalRestart` first when any failed role cannot be restarted in place (`asked`: a snapshot from
        `ask()`, else one is asked now). The caller restarts them, then calls `restarted` for each."""
        bad = self.failures(asked)
        for name, reason in bad.items():
            self._refuse(name, reason)
        for name, reason in bad.items():
            self.failed(name, reason)
        return list(bad)

    def failed(self, name: str, reason: str) -> None:
        """Role `name` failed for `reason`: count a restart in place if it is stateless and under its
        restart budget, else raise `GlobalRestart`. Also called directly when a failure is seen before
        the heartbeats show it (a weight receiver that refuses the push)."""
        self._refuse(name, reason)
        count = self.role_restarts[name] = self.role_restarts.get(name, 0) + 1
        budget = self.ops.max_role_restarts
        logger.warning("role %s failed: %s; restarting it in place (%d of %d)", name, reason, count, budget)
        self.notifier.restart(name, f"{reason}; restarting it in place ({count} of {budget})")

    def _refuse(self, name: str, reason: str) -> None:
        """Raise `GlobalRestart` when role `name` may not be restarted in place once more."""
        if name not in STATELESS:
            raise GlobalRestart(name, reason)
        count = self.role_restarts.get(name, 0) + 1
        if count > self.ops.max_role_restarts:
            raise GlobalRestart(
                name,
                f"{reason}; failed {count} times (ops.max_role_restarts={self.ops.max_role_restarts})",
            )

    def restarted(self, name: str) -> None:
        """Role `name` was restarted in place: wait for its new replica's heartbeat, and watch that one."""
        self.watch([name], replacing=name)

    # -- engines -----------------------------------------------------------------------------
    def engines_replaced(self, info: dict) -> bool:
        """The Rollout's `replace_dead_engines` answer (`urls`: survivors and replacements, `replaced`: how
        many now): count and report the replacements; returns whether the weight-sync group must re-form
        (the caller, `WeightPush`, has `WeightGroup` do it)."""
        if not info["replaced"]:
            return False
        self.engine_restarts += info["replaced"]
        self.notifier.restart(
            "engine", f"{info['replaced']} inference engine(s) replaced; engines now {info['urls']}"
        )
        return True

    def engines_starved(self, snap: dict[str, dict[str, Any]]) -> bool:
        """Whether the Rollout's requests wait for replacement engines that hold no weights yet (its
        supervisor's `engines` beat, relax/fleet/engine_recovery.py)."""
        info = snap.get("engines", {}).get("info", {})
        return bool(info.get("waiting")) and bool(info.get("pending"))

    def watch_engines(self, repair: Callable[[], None]) -> None:
        """From now until `unwatch_engines`, read the board every heartbeat interval on a daemon thread
        and call `repair()` (which pushes the current weights to the pending replacements) whenever
        requests wait for them. A failed repair is logged and tried again; the requests' own wait is
        bounded (`Router.replacement_wait_s`)."""
        self.unwatch_engines()
        stop = self._engine_watch = threading.Event()

        def loop() -> None:
            while not stop.wait(self.ops.heartbeat_interval_s):
                try:
                    if self.engines_starved(self._snapshot()) and not stop.is_set():
                        logger.warning("requests wait for replacement engines: pushing them the weights now")
                        repair()
                except Exception:  # noqa: BLE001 - the next round tries again
                    logger.exception("pushing the weights to replacement engines failed")

        threading.Thread(target=loop, name="engine-watch", daemon=True).start()

    def unwatch_engines(self) -> None:
        stop, self._engine_watch = self._engine_watch, None
        if stop is not None:
            stop.set()

    def metrics(self) -> dict[str, float]:
        return {
            "health/role_restarts": float(sum(self.role_restarts.values())),
            "health/engine_restarts": float(self.engine_restarts),
        }
