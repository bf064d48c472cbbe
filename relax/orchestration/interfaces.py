"""The small interfaces the driver's parts are given at construction: how a wait on a role is made
(`Wait`), how the time of a long wait is watched (`Watch`), and how a role is restarted in place
(`Redeploy`). The run passes the `Watchdog` (relax/orchestration/watchdog.py) for the first two and the
`Deployment` (relax/orchestration/deployment.py) for the third; unit tests pass the simple ones here.
"""

from __future__ import annotations

from typing import Any, Protocol


class Wait(Protocol):
    def wait(self, response: Any, role: str, phase: str) -> Any:
        """`response.result()` (a Serve response from role `role`, doing `phase`)."""


class Watch(Protocol):
    def check(self, role: str, phase: str) -> None:
        """Raise when the wait on `role` doing `phase` has run out of time."""


class Redeploy(Protocol):
    def redeploy(self, name: str) -> Any:
        """Restart role `name` in place; returns the new replica's handle."""


class PlainWait:
    """Waits without deadlines (unit tests; nothing watches the time)."""

    def wait(self, response: Any, role: str, phase: str) -> Any:
        return response.result()

    def check(self, role: str, phase: str) -> None:
        return None
