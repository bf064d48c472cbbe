"""The fault suite's phase hook, loaded by every Python process of a run the harness starts (this folder
is first on their PYTHONPATH, so Python imports it at start-up; Ray workers inherit the variable).

Without `RELAX_FAULT_DIR` in the environment it does nothing. With it, a few methods of Relax are wrapped
as their modules are imported, each marking one phase of a step (the rollout and the weight push have
fault points in Relax itself, relax/utils/faults.py, which the harness uses instead):

    update      ActorRole.train_sync    (Actor: the optimizer step starts)
    checkpoint  ActorRole.save          (Actor: the checkpoint is being written)
    eval        RolloutRole.evaluate    (Rollout: an evaluation starts)

The harness arms one phase by writing `{"phase": ..., "hold_s": ...}` to `<dir>/arm`. The first call
of that phase's method anywhere in the run claims it (`<dir>/claimed`, O_EXCL: exactly one process
wins), writes its pid and time to `<dir>/hit` and waits `hold_s` before going on, so the phase is still
open when the harness, which watches for `hit`, injects its fault (kill -9, a signal, a full disk).
Relax itself is unchanged; this is how the suite reaches a phase that lasts milliseconds in a tiny run.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
import time

FAULT_DIR = os.environ.get("RELAX_FAULT_DIR")

# module -> (class, method, phase)
TARGETS = {
    "relax.roles.actor": [("ActorRole", "train_sync", "update"), ("ActorRole", "save", "checkpoint")],
    "relax.roles.rollout": [("RolloutRole", "evaluate", "eval")],
}


def claim(phase: str) -> float:
    """If `phase` is armed and not yet hit, record the hit; returns how long to hold (0: go on)."""
    try:
        with open(os.path.join(FAULT_DIR, "arm")) as f:
            armed = json.load(f)
    except (OSError, ValueError):
        return 0.0
    if armed.get("phase") != phase:
        return 0.0
    try:
        os.close(os.open(os.path.join(FAULT_DIR, "claimed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # another call was first
        return 0.0
    tmp = os.path.join(FAULT_DIR, f"hit.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"phase": phase, "pid": os.getpid(), "time": time.time()}, f)
    os.rename(tmp, os.path.join(FAULT_DIR, "hit"))  # the harness sees the whole record at once
    return float(armed.get("hold_s", 0.0))


def _wrap(fn, phase: str):
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            if hold := claim(phase):
                await asyncio.sleep(hold)  # only this call waits; the event loop goes on
            return await fn(*args, **kwargs)

    else:

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if hold := claim(phase):
                time.sleep(hold)
            return fn(*args, **kwargs)

    return wrapper


def _patch(module, entries) -> None:
    for cls_name, method, phase in entries:
        cls = getattr(module, cls_name, None)
        fn = getattr(cls, method, None) if cls is not None else None
        if fn is None:  # renamed: the harness then waits for a hit that never comes, and says so
            print(f"relax fault hook: {module.__name__}.{cls_name}.{method} not found", file=sys.stderr)
            continue
        setattr(cls, method, _wrap(fn, phase))


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a target module right after its code ran, before anyone uses it."""

    def find_spec(self, name, path, target=None):
        if name not in TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module, TARGETS[name])

        spec.loader.exec_module = exec_module
        return spec


if FAULT_DIR:
    sys.meta_path.insert(0, _Finder())
