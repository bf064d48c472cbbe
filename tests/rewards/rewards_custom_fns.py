"""User-style reward functions for the scorer tests, configured by import path
(``rewards_custom_fns:<name>``; pytest puts this folder on ``sys.path``)."""

from __future__ import annotations

import asyncio
import threading
import time

from relax.data.sample import Sample
from relax.rewards import RewardSpec, reward_fn


def length_reward(sample: Sample, scale: float = 1.0) -> float:
    """Sync, per-sample, number."""
    return scale * len(sample.response_text)


async def async_dict_reward(sample: Sample) -> dict[str, float]:
    """Async, per-sample, dict with extra metrics."""
    await asyncio.sleep(0)
    return {"score": float(sample.response_text == sample.label), "chars": float(len(sample.response_text))}


@reward_fn(kind="group")
def group_rank(samples: list[Sample]) -> list[float]:
    """Sync, per-group: 1 for the shortest response of the group, 0 for the others."""
    shortest = min(len(s.response_text) for s in samples)
    return [float(len(s.response_text) == shortest) for s in samples]


@reward_fn(kind="group")
async def async_group_dict(samples: list[Sample]) -> list[dict[str, float]]:
    """Async, per-group, dicts: the group size is logged as a metric."""
    await asyncio.sleep(0)
    return [{"reward": float(i), "group_size": float(len(samples))} for i, _ in enumerate(samples)]


def _wrong_length_group(samples: list[Sample]) -> list[float]:
    return [1.0] * (len(samples) + 1)


wrong_length_group = RewardSpec(_wrong_length_group, kind="group")  # declared by a spec, not a decorator


def raises(sample: Sample) -> float:
    raise RuntimeError(f"boom on {sample.index}")


def needs_missing_package(sample: Sample) -> float:
    import no_such_package_xyz  # noqa: F401

    return 1.0


# The slow and hanging calls below block until the test sets RELEASE (or `seconds` pass) and then record
# their name in FINISHED: a scorer that returned before its slow call finished shows it by its absence.
# Each call keeps the objects current when it started, so a call left over from an earlier test never
# lands in a later test's list (`reset_slow` gives every test new ones).
RELEASE = threading.Event()
FINISHED: list[str] = []


def reset_slow() -> None:
    global RELEASE, FINISHED
    RELEASE, FINISHED = threading.Event(), []


def slow_sync(sample: Sample, seconds: float = 30.0) -> float:
    release, finished = RELEASE, FINISHED
    release.wait(seconds)
    finished.append("slow_sync")
    return 1.0


async def slow_async(sample: Sample, seconds: float = 30.0) -> float:
    finished = FINISHED
    await asyncio.sleep(seconds)
    finished.append("slow_async")
    return 1.0


def returns_nan(sample: Sample) -> float:
    return float("nan")


def returns_text(sample: Sample) -> str:
    return "1.0"


class InFlight:
    """Counts concurrent calls (shared by the concurrency tests)."""

    lock = threading.Lock()
    now = 0
    peak = 0

    @classmethod
    def reset(cls) -> None:
        cls.now, cls.peak = 0, 0

    @classmethod
    def enter(cls) -> None:
        with cls.lock:
            cls.now += 1
            cls.peak = max(cls.peak, cls.now)

    @classmethod
    def leave(cls) -> None:
        with cls.lock:
            cls.now -= 1


async def tracked_async(sample: Sample) -> float:
    InFlight.enter()
    try:
        await asyncio.sleep(0.05)
    finally:
        InFlight.leave()
    return 1.0


def tracked_sync(sample: Sample) -> float:
    InFlight.enter()
    try:
        time.sleep(0.05)
    finally:
        InFlight.leave()
    return 1.0


THREADS: list[int] = []  # the worker thread of each `cheap_rule` call


def cheap_rule(sample: Sample) -> float:
    """A rule reward that takes microseconds, except on "hang" (until RELEASE, at most 30 s) and "boom"
    (raises)."""
    THREADS.append(threading.get_ident())
    if sample.response_text == "hang":
        release, finished = RELEASE, FINISHED
        release.wait(30.0)
        finished.append("hang")
    if sample.response_text == "boom":
        raise ValueError("boom")
    return float(sample.response_text == sample.label)


not_callable = 42


def exits(sample: Sample) -> float:
    """A reward that ends the process the way a careless script does."""
    import sys

    sys.exit(3)


async def exits_async(sample: Sample) -> float:
    import sys

    sys.exit(4)
