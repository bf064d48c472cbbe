"""Keep Python's cyclic garbage collector off the objects a long-running process builds at start-up.

A Relax role holds a few hundred thousand objects once torch, transformers, Ray and its model are loaded
(about 420 thousand in a Rollout or Actor replica on the toy task). Python's oldest-generation collection
walks all of them, and the rows a step moves through the data plane allocate enough to trigger one every
few steps, each a pause of a large fraction of a second on a small host that showed up as a slow
data-plane read (`perf/actor_wait_data_s`; docs/measurements.md). `gc.freeze()` after start-up moves those objects to a
permanent generation that collections skip, the remedy CPython documents for this case (and that
long-running inference servers apply after loading). Objects created later are collected as before; the
frozen ones are start-up state that lives as long as the process anyway.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)


# Generation 0's threshold while a process imports (default 700 allocations): importing torch,
# transformers and a role's modules creates about half a million objects, and every collection the
# default threshold triggers on the way walks the young ones, and every tenth of those the older ones.
STARTUP_GEN0_THRESHOLD = 50_000
_default_thresholds: tuple[int, int, int] | None = None  # set while `quiet_startup` is in force


def _enabled() -> bool:
    return os.environ.get("RELAX_GC_FREEZE", "1") != "0"


def started_as_ray_worker() -> bool:
    """Whether this process is a Ray worker (Ray starts every worker, so every role replica and actor,
    as `python .../ray/_private/workers/default_worker.py`)."""
    return bool(sys.argv) and sys.argv[0].endswith(os.path.join("workers", "default_worker.py"))


def quiet_startup() -> None:
    """For a process about to import its role: freeze what is loaded (Ray's own modules) and collect
    generation 0 less often, until `freeze_startup_objects` ends the start-up: fewer passes of the
    collector over the modules a role imports (torch, transformers, Relax's; docs/measurements.md has
    the saving). A process that never calls `freeze_startup_objects` keeps the higher threshold, which
    only delays its young collections."""
    global _default_thresholds
    if not _enabled() or _default_thresholds is not None:
        return
    _default_thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(STARTUP_GEN0_THRESHOLD, *_default_thresholds[1:])


def freeze_startup_objects() -> int:
    """Collect once, then freeze every object alive now, and collect at the default thresholds again
    (`quiet_startup`); returns how many are frozen (0 when the environment sets RELAX_GC_FREEZE=0, to
    compare or to rule it out)."""
    global _default_thresholds
    if not _enabled():
        return 0
    gc.collect()
    gc.freeze()
    if _default_thresholds is not None:
        gc.set_threshold(*_default_thresholds)
        _default_thresholds = None
    frozen = gc.get_freeze_count()
    logger.debug("gc: %d start-up objects frozen", frozen)
    return frozen


def with_frozen_startup(cls: type) -> type:
    """A subclass of `cls` whose instances freeze the process's start-up objects once constructed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, *args, **kwargs)
        freeze_startup_objects()

    # `__module__` is this module, where the name does not resolve: Ray pickles the subclass by value
    # (by reference it would find, and run, the plain `cls`)
    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__})


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off for a burst of allocations that all live on, such as the prefix-cache
    entries of a step where hundreds of long rows finish at once (~100 thousand objects): collections
    triggered inside the burst each walk the older heap again (most of that step's time), while after it
    the burst is collected once. Nested uses and a collector already off are left as they are."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
