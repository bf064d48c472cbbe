"""A request to stop the run, made by the operator (SIGTERM, Ctrl-C: the command line's signal handler,
relax/entrypoints/signals.py, or a test) and read by the driver.

Before the first step a stop ends the start (`check` between the start's phases, and the role deployment
polls `requested`); once steps run, the step in flight finishes and its checkpoint is saved, within
`ops.stop_grace_s` of the request (the Watchdog reads `asked_at`).
"""

from __future__ import annotations

import threading
import time

from relax.orchestration.service import RunStopped


class StopRequest:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.asked_at: float | None = None  # when the stop was requested (time.monotonic), or None
        # what a stop does now (logged when one is requested): the driver sets it when steps begin
        self.effect = "stopping the start (send it again to stop at once)"

    @property
    def requested(self) -> bool:
        return self.asked_at is not None

    def request(self) -> bool:
        """Ask the run to stop; returns False when a stop had already been requested."""
        with self._lock:
            if self.asked_at is not None:
                return False
            self.asked_at = time.monotonic()
            return True

    def steps_begin(self, grace_s: float) -> None:
        """From now on a stop lets the step in flight finish (within `grace_s`) and saves it."""
        self.effect = (
            f"finishing the current step (at most ops.stop_grace_s={grace_s:g}s), then saving a checkpoint "
            "(press Ctrl-C again to stop at once)"
        )

    def check(self, phase: str) -> None:
        """Raise `RunStopped` when a stop was requested (the start checks this between its phases)."""
        if self.requested:
            raise RunStopped(f"stop requested before {phase}")
