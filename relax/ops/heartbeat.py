"""Heartbeats: every service posts `(name, incarnation, pid)` to one board every
`ops.heartbeat_interval_s`; the HealthManager (`relax.orchestration.health`) reads the board.

* `HeartbeatBoard` is a named Ray actor (no CPU reserved). Ages are measured on the board's own clock,
  so the clocks of other processes do not matter.
* A sender inside a Ray actor hands the board its actor handle, pickled, with its first beat: the board
  unpickles it only to ping, because unpickling a handle loads the sender's class (for a Serve replica,
  `ray.serve` and its imports: most of the board's start-up CPU). A beat that is late
  (`snapshot(probe_after_s)`) is not yet a failure: a busy process beats late. But the board then asks
  Ray whether the sender's actor is alive (a ping to it), and a dead one is reported at once (`dead`),
  so a killed role is found within a few heartbeat intervals rather than after
  `ops.heartbeat_timeout_s`, and before Serve starts a replica in its place.
* `Heartbeat` is the sender: a daemon thread inside the service's process. A new incarnation id per
  process tells the reader that a replica was replaced (by Serve or by us) and lost its state.
* `with_heartbeat(cls, name, interval_s)` makes a role class beat from its constructor on, so the role
  classes stay plain (Serve deploys the subclass; tests use the classes directly).
* Inference engines are not Serve roles: the Rollout's `EngineSupervisor` (`relax.fleet.engine_recovery`)
  checks each engine actor and posts `engine/<i>` beats for it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from typing import Any

logger = logging.getLogger(__name__)

BOARD_NAME, NAMESPACE = "relax_heartbeats", "relax"
FIRST_BEAT_S = 10.0  # the longest a role's constructor waits for the board to take its first beat
PING_WAIT_S = 0.3  # the longest a snapshot waits for the pings it sent to late senders


class HeartbeatBoard:
    """name -> the last beat: incarnation, pid, board time, and what the sender says about itself."""

    def __init__(self) -> None:
        self.beats: dict[str, dict[str, Any]] = {}
        # (name, incarnation) -> the sender's actor handle, pickled until the first ping unpickles it
        self.actors: dict[tuple[str, str], Any] = {}
        self.pings: dict[tuple[str, str], Any] = {}  # (name, incarnation) -> a ping not answered yet
        self.dead: set[tuple[str, str]] = set()  # senders whose actor Ray reported dead

    def beat(
        self, name: str, incarnation: str, pid: int, info: dict | None = None, actor: bytes | None = None
    ) -> None:
        """`actor`: the sender's own actor handle, pickled (its first beat; None outside an actor)."""
        old = self.beats.get(name)
        if old is not None and old["incarnation"] != incarnation:
            self._forget_incarnation(name, old["incarnation"])
        if actor is not None:
            self.actors[(name, incarnation)] = actor
        self.beats[name] = {
            "incarnation": incarnation,
            "pid": pid,
            "at": time.monotonic(),
            "info": info or {},
        }

    def forget(self, name: str) -> None:
        if (old := self.beats.pop(name, None)) is not None:
            self._forget_incarnation(name, old["incarnation"])

    def _forget_incarnation(self, name: str, incarnation: str) -> None:
        key = (name, incarnation)
        self.actors.pop(key, None)
        self.pings.pop(key, None)
        self.dead.discard(key)

    def snapshot(self, probe_after_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Every sender's last beat with `age_s`, seconds since it by this board's clock, and `dead`:
        whether Ray reported the sender's actor dead. With `probe_after_s`, every sender silent longer
        than that is pinged first (answers wait up to `PING_WAIT_S`; a ping still unanswered is asked
        again by the next snapshot)."""
        now = time.monotonic()
        if probe_after_s is not None:
            self._probe([n for n, b in list(self.beats.items()) if now - b["at"] > probe_after_s])
        return {
            n: {**b, "age_s": now - b["at"], "dead": (n, b["incarnation"]) in self.dead}
            for n, b in list(self.beats.items())
        }

    def _probe(self, names: list[str]) -> None:
        """Ping the actors of `names`; an actor Ray reports dead is marked so. An actor that is alive but
        busy leaves its ping pending: only Ray's word makes a sender dead."""
        import ray
        from ray import cloudpickle
        from ray.exceptions import ActorDiedError

        asked: dict[Any, tuple[str, str]] = {}
        for name in names:
            key = (name, self.beats[name]["incarnation"]) if name in self.beats else None
            if key is None or key in self.dead or (actor := self.actors.get(key)) is None:
                continue
            if isinstance(actor, bytes):
                actor = self.actors[key] = cloudpickle.loads(actor)
            if (ping := self.pings.get(key)) is None:
                ping = self.pings[key] = actor.__ray_ready__.remote()
            asked[ping] = key
        if not asked:
            return
        answered, _ = ray.wait(list(asked), num_returns=len(asked), timeout=PING_WAIT_S)
        for ping in answered:
            key = asked[ping]
            self.pings.pop(key, None)
            try:
                ray.get(ping)
            except ActorDiedError:
                self.dead.add(key)
            except Exception:  # noqa: BLE001 - unreachable for now (a node's network): not dead by Ray's word
                pass


def create_board() -> Any:
    """A fresh board for this run (a named Ray actor). A board left by an earlier run in this cluster is
    killed first: reusing it would hand out a handle to an actor that dies with its old owner."""
    import ray

    close_board()
    remote = ray.remote(num_cpus=0, max_concurrency=64)(HeartbeatBoard)
    return remote.options(name=BOARD_NAME, namespace=NAMESPACE).remote()


def close_board(timeout_s: float = 30.0) -> None:
    """Kill the board, if any, and wait until its name is free."""
    import ray

    deadline = time.monotonic() + timeout_s
    while (board := get_board()) is not None:
        ray.kill(board, no_restart=True)
        if time.monotonic() > deadline:
            raise RuntimeError(f"heartbeat board {BOARD_NAME!r} did not go away within {timeout_s:.0f}s")
        time.sleep(0.1)


def get_board() -> Any | None:
    import ray

    try:
        return ray.get_actor(BOARD_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


class Heartbeat:
    """Posts a beat for `name` every `interval_s` seconds from a daemon thread of this process."""

    def __init__(self, name: str, interval_s: float) -> None:
        self.name = name
        self.interval_s = interval_s
        self.incarnation = uuid.uuid4().hex
        self._stop = threading.Event()
        self._actor = _own_actor()

    def start(self) -> Heartbeat:
        """Post the first beat and wait for the board to take it, then beat from the thread. A replica
        that Serve put in place of a dead one is constructed before it takes calls, so its new
        incarnation is on the board before any call can reach it: a caller that sees a call fail can
        tell from the board that the replica it initialised is gone."""
        board = self._first_beat()
        self._thread = threading.Thread(
            target=self._run, args=(board,), name=f"heartbeat-{self.name}", daemon=True
        )
        self._thread.start()
        return self

    def _first_beat(self) -> Any:
        import ray

        try:
            board = get_board()
            if board is not None:
                beat = board.beat.remote(self.name, self.incarnation, os.getpid(), None, self._actor)
                ray.get(beat, timeout=FIRST_BEAT_S)
            return board
        except Exception:  # noqa: BLE001 - the board may be restarting; the thread beats again
            logger.warning("%s: the first heartbeat was not taken; beating from the thread", self.name)
            return None

    def _run(self, board: Any) -> None:
        holds_actor = board  # the board that was handed this process's actor handle
        self._stop.wait(self.interval_s)
        while not self._stop.is_set():
            try:
                board = board or get_board()
                if board is not None:
                    actor = self._actor if board is not holds_actor else None
                    board.beat.remote(self.name, self.incarnation, os.getpid(), None, actor)
                    holds_actor = board
            except Exception:  # noqa: BLE001 - the board may be restarting; beat again next time
                board = None
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()


def _own_actor() -> bytes | None:
    """This process's Ray actor handle, pickled, or None outside an actor (a driver, a test)."""
    try:
        import ray
        from ray import cloudpickle

        return cloudpickle.dumps(ray.get_runtime_context().current_actor)
    except Exception:  # noqa: BLE001 - not in an actor, or Ray is not initialised
        return None


def with_heartbeat(cls: type, name: str, interval_s: float) -> type:
    """A subclass of role class `cls` whose instances beat as `name` once constructed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, *args, **kwargs)
        self._heartbeat = Heartbeat(name, interval_s).start()

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__})
