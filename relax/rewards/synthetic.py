"""``token_rate``: a synthetic reward for throughput benchmarks and smoke runs on random models.

The reward of a response is the fraction of its tokens whose id is a multiple of ``modulus``:

    r(y) = |{t in y : t mod m = 0}| / |y|,   r = 0 for an empty response.

A random-initialised model samples such tokens at about 1/m of the time and the rate varies between
samples of one prompt, so GRPO has a learning signal on any vocabulary without a real task; the
rate rising above 1/m shows the updates reach the engines.
"""

from __future__ import annotations

from relax.data.sample import Sample


def token_rate(sample: Sample, modulus: int = 8) -> float:
    if modulus < 1:
        raise ValueError(f"token_rate: modulus must be >= 1, got {modulus}")
    ids = sample.response_ids
    if not ids:
        return 0.0
    return sum(1 for t in ids if t % modulus == 0) / len(ids)
