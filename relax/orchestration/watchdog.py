"""A step that stops making progress becomes a clear failure, never a silent stall; a stop request ends
the run even when the step in flight never finishes.

Every wait of the driver on a role goes through `Watchdog.wait(response, role, phase)`: it waits in
short slices and between them checks two deadlines:

* `ops.step_timeout_s`: a step (rollout, update, weight push, evaluation) running longer than this fails
  the run with `StepStalled`, which names the role and the phase that did not answer;
* `ops.stop_grace_s`: after a stop request (SIGTERM, Ctrl-C) the step in flight may finish for this long
  (its checkpoint is then saved); past it the run stops with `RunStopped` without the checkpoint.

Between slices it also calls `probe` (the HealthManager's `check_state`), which raises when a role with
training state died: Serve would hold the call until a replacement replica started, which lacks that
state, so waiting on it only delays the global restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from relax.orchestration.service import RunStopped
from relax.orchestration.stop import StopRequest

SLICE_S = 1.0  # how often a wait looks at the deadlines


class StepStalled(RuntimeError):
    """A role made no progress on a step for `ops.step_timeout_s`."""

    def __init__(self, role: str, phase: str, step: int, waited_s: float) -> None:
        super().__init__(
            f"step {step} stalled: {role} did not finish {phase} within {waited_s:.0f}s (ops.step_timeout_s); "
            f"look at {role}'s log for a hang (a reward, an engine, a data-plane wait), or raise ops.step_timeout_s "
            "if steps are this long"
        )
        self.role, self.phase, self.step, self.waited_s = role, phase, step, waited_s

    def __reduce__(self) -> tuple:  # Ray sends it between processes: rebuilt from its fields, not its text
        return type(self), (self.role, self.phase, self.step, self.waited_s)


class Watchdog:
    """The driver's `Wait` and `Watch` (relax/orchestration/interfaces.py) of a run."""

    def __init__(
        self,
        step_timeout_s: float | None,
        stop_grace_s: float,
        stop: StopRequest,
        probe: Callable[[], None] | None = None,
    ) -> None:
        """`probe`: called between the slices of a wait; it raises to end the wait (a lost role)."""
        self.step_timeout_s, self.stop_grace_s, self.stop = step_timeout_s, stop_grace_s, stop
        self.probe = probe
        self.step = 0
        self._step_started = time.monotonic()

    def begin_step(self, step: int) -> None:
        self.step, self._step_started = step, time.monotonic()

    def check(self, role: str, phase: str) -> None:
        """Raise if the step ran out of time or a stop request's grace is over."""
        now = time.monotonic()
        if self.step_timeout_s is not None and now - self._step_started > self.step_timeout_s:
            raise StepStalled(role, phase, self.step, now - self._step_started)
        asked = self.stop.asked_at
        if asked is not None and now - asked > self.stop_grace_s:
            raise RunStopped(
                f"stop requested; {role} did not finish {phase} of step {self.step} within "
                f"ops.stop_grace_s={self.stop_grace_s:g}s, so the run stops without saving it"
            )

    def wait(self, response: Any, role: str, phase: str) -> Any:
        """`response.result()` (a Serve response), checking the deadlines while it is not there. A wait
        that ends without the result cancels the call: Serve queues a call to a dead replica, and a
        call left queued would reach the replica of the role deployed again under the same name by a
        global restart, as a second call of a step the restarted run makes itself."""
        try:
            while True:
                try:
                    return response.result(timeout_s=SLICE_S)
                except TimeoutError:
                    self.check(role, phase)
                    if self.probe is not None:
                        self.probe()
        except BaseException:
            response.cancel()
            raise
