"""A user reward for the end-to-end tests, configured by import path ``tests.e2e.reward_fns:<name>``
(Ray puts the driver's working directory, the repository root, on every worker's ``sys.path``)."""

from __future__ import annotations

import asyncio

from relax.data.sample import Sample
from relax.rewards.text import first_number


def flaky_exact_match(sample: Sample) -> float:
    """Exact match of the stripped response, but raises on every second sample of a group."""
    if sample.sample_id % 2:
        raise RuntimeError(f"flaky reward failed on sample {sample.index}/{sample.sample_id}")
    return float(sample.response_text.strip() == str(sample.label))


async def slow_on_long_rows(sample: Sample, delay_s: float = 1.0) -> float:
    """`first_number`, but `delay_s` slower on rows whose metadata allows long answers: a slow verifier on
    the long tail, so such groups finish well after a step running ahead has written its short ones."""
    if sample.metadata.get("slow"):
        await asyncio.sleep(delay_s)
    return first_number(sample)
