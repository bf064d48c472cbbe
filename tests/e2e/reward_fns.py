"""A user reward for the end-to-end tests, configured by import path ``tests.e2e.reward_fns:<name>``
(Ray puts the driver's working directory, the repository root, on every worker's ``sys.path``)."""

from __future__ import annotations

from relax.data.sample import Sample


def flaky_exact_match(sample: Sample) -> float:
    """Exact match of the stripped response, but raises on every second sample of a group."""
    if sample.sample_id % 2:
        raise RuntimeError(f"flaky reward failed on sample {sample.index}/{sample.sample_id}")
    return float(sample.response_text.strip() == str(sample.label))
