"""CPU budgets: pinning a role's process to a set of CPUs (`resources.rollout_cpus`,
`resources.training_cpus`).

On a host without accelerators, rollout (the engines, the Rollout role, Advantages) and training (the
Actor and its ranks, ActorFwd, Reference) compete for the same cores. Torch's thread counts
(`rollout.engine_threads`, `trainer.threads`) bound only the matrix work; the Python around it (HTTP,
serialisation, scoring, the optimiser's bookkeeping) then runs on whichever core is free, so the
trainer's update is preempted by rollout work whenever the two overlap. Pinning each side to its own
CPUs makes the budgets real: in hybrid and fully_async modes the update runs undisturbed on its cores
while generation fills the others; in colocate each phase keeps to its own cores while the other
phase's cores sit idle, which is the cost the streaming modes remove. The processes that serve every
role (the driver, the data plane, Ray's daemons, Metrics) are not pinned.

The lists use the Linux `taskset -c` syntax (`"0"`, `"0-3,8"`). Pinning sets the affinity of every
thread the process has (a thread started later inherits the affinity of the thread that starts it).
Where the OS has no `sched_setaffinity` (macOS) pinning is skipped with a warning.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> frozenset[int]:
    """`"0-3,8"` -> {0, 1, 2, 3, 8}; raises ValueError naming the malformed part."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(
                f"CPU list {text!r}: {part!r} is not a CPU number or range; write it like '0' or '0-3,8'"
            ) from None
        if first < 0 or last < first:
            raise ValueError(
                f"CPU list {text!r}: {part!r} is not a range of CPU numbers (low-high, low <= high)"
            )
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        return [0]


def pin_process(cpus: str, what: str) -> frozenset[int] | None:
    """Pin every thread of this process to the CPUs `cpus` names; `what` names the setting in errors
    (e.g. ``"resources.rollout_cpus"``). Returns the set pinned to (None where the OS cannot pin)."""
    wanted = parse_cpu_list(cpus)
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("%s=%r ignored: this OS cannot pin processes to CPUs", what, cpus)
        return None
    host = os.cpu_count() or 1
    missing = sorted(c for c in wanted if c >= host)
    if missing:
        raise ValueError(
            f"{what}={cpus!r} names CPU(s) {missing} but this host has CPUs 0-{host - 1}; list CPUs of this "
            f"host, or unset {what} to let the role use any CPU"
        )
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, wanted)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as e:  # EINVAL: none of the CPUs is allowed here (a cgroup cpuset)
            raise ValueError(
                f"{what}={cpus!r}: this process may not run on those CPUs ({e}); it may use "
                f"{_format(os.sched_getaffinity(0))}. List CPUs from that set, or unset {what}"
            ) from e
    logger.info("%s: pid %d pinned to CPUs %s", what, os.getpid(), _format(wanted))
    return wanted


def with_cpu_affinity(cls: type, cpus: str | None, what: str) -> type:
    """A subclass of `cls` whose instances pin their process to `cpus` before `cls.__init__` runs (so
    the threads the constructor starts inherit it); `cls` itself when `cpus` is None."""
    if cpus is None:
        return cls

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        pin_process(cpus, what)
        cls.__init__(self, *args, **kwargs)

    # Ray pickles the subclass by value: its module must not be one where the name resolves to `cls`
    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__})


def _format(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
