"""Reward functions for the reward-pool tests. Pool workers are other processes, so these are configured
by the package path ``tests.rewards.pool_fns:<name>`` (Ray puts the driver's working directory, the
repository root, on the workers' ``sys.path``)."""

from __future__ import annotations

import asyncio
import os
import time

from relax.data.sample import Sample
from relax.rewards import reward_fn


async def stamped(sample: Sample, sleep_s: float = 0.2) -> dict[str, float]:
    """Reward 1; records when the call ran and in which process (to measure concurrency)."""
    t0 = time.time()
    await asyncio.sleep(sleep_s)
    return {"reward": 1.0, "t0": t0, "t1": time.time(), "pid": float(os.getpid())}


def fails_on_odd(sample: Sample) -> float:
    """Raises on odd prompt indices, 1 otherwise."""
    if sample.index % 2:
        raise ValueError(f"cannot score row {sample.index}")
    return 1.0


async def hangs_on_odd(sample: Sample) -> float:
    """Runs (nearly) forever on odd prompt indices, 1 otherwise."""
    if sample.index % 2:
        await asyncio.sleep(60)
    return 1.0


@reward_fn(kind="group")
def group_size(samples: list[Sample]) -> list[dict[str, float]]:
    """Each sample's reward is the size of the group it was scored with; the pid says where."""
    return [{"reward": float(len(samples)), "pid": float(os.getpid())} for _ in samples]


def crashes_on_index_3(sample: Sample) -> float:
    """Kills its worker process on prompt index 3 (a segfaulting native library, say)."""
    if sample.index == 3:
        os._exit(1)
    return 1.0
