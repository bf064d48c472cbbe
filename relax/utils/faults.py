"""Fault-injection points: named places in the code where the fault suite can hold a process, so that a
fault (a killed engine, a full disk) lands at a chosen phase instead of wherever a timer falls.

Off unless `RELAX_FAULT_DIR` names a folder in the environment of the process that reaches the point
(set it before Ray starts: every Ray worker inherits the environment of the process that started the
cluster). Then, at point `NAME`:

1. if `<dir>/NAME.hold` exists, the process writes `<dir>/NAME.reached` (its pid) and waits while the
   hold file exists (at most `HOLD_MAX_S`); the test injects its fault meanwhile and removes the hold
   file to let the process go on;
2. otherwise it goes on at once. The hold file may hold a number k: the point then holds at the k-th
   time it is reached (in one process) after the file appeared; empty means the first. A hold fires
   once: later callers pass while `NAME.reached` exists.

`hold(dir, name)`, `wait_reached(dir, name)` and `release(dir, name)` are the test side.

Points (process: where):

* `router.request` (Rollout): an engine request is about to be sent (rollout or evaluation);
* `weight_push.push` (driver): the weight-sync group is formed and the Actor's push is about to start.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

ENV = "RELAX_FAULT_DIR"
HOLD_MAX_S = 600.0  # a hold the test never releases ends here (the test failed; the run goes on)
POLL_S = 0.05
_reaches: dict[tuple[str, int], int] = {}  # (point, its hold file's mtime) -> times reached here


def _armed(name: str) -> Path | None:
    """The hold file of point `name` if this point should hold now (and claims it), else None."""
    folder = os.environ.get(ENV)
    if not folder:
        return None
    held = Path(folder) / f"{name}.hold"
    reached = Path(folder) / f"{name}.reached"
    if reached.exists():
        return None
    try:
        stat, text = held.stat(), held.read_text().strip()
    except FileNotFoundError:
        return None
    key = (name, stat.st_mtime_ns)  # reaches are counted per hold file
    _reaches[key] = _reaches.get(key, 0) + 1
    if _reaches[key] < int(text or 1):
        return None
    reached.write_text(str(os.getpid()))
    return held


def point(name: str) -> None:
    """A fault-injection point (blocking: driver threads)."""
    held = _armed(name)
    deadline = time.monotonic() + HOLD_MAX_S
    while held is not None and held.exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)


async def apoint(name: str) -> None:
    """A fault-injection point on an event loop (the loop keeps running while it holds)."""
    held = _armed(name)
    deadline = time.monotonic() + HOLD_MAX_S
    while held is not None and held.exists() and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)


# -- the test side ---------------------------------------------------------------------------
def hold(folder: Path, name: str, at: int = 1) -> None:
    """Arm point `name`: a process that reaches it for the `at`-th time from now waits there."""
    (Path(folder) / f"{name}.reached").unlink(missing_ok=True)
    (Path(folder) / f"{name}.hold").write_text(str(at))


def wait_reached(folder: Path, name: str, timeout_s: float = HOLD_MAX_S) -> int:
    """Wait until a process holds at point `name`; returns its pid."""
    reached = Path(folder) / f"{name}.reached"
    deadline = time.monotonic() + timeout_s
    while not reached.exists() or not reached.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no process reached fault point {name!r} within {timeout_s:.0f}s")
        time.sleep(POLL_S)
    return int(reached.read_text())


def release(folder: Path, name: str) -> None:
    """Let the process held at point `name` go on."""
    (Path(folder) / f"{name}.hold").unlink(missing_ok=True)
