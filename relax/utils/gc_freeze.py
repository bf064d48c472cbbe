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

import gc
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Collect once, then freeze every object alive now; returns how many are frozen (0 when the
    environment sets RELAX_GC_FREEZE=0, to compare or to rule it out)."""
    if os.environ.get("RELAX_GC_FREEZE", "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
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
