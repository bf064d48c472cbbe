"""Cost of one batched sampling step: the inverse-CDF draw, the exponential race and (CUDA with Triton)
the fused kernel (`fused_sampling.py`), same logits.

`relax/backends/inference/embedded/sampling/sampling.py` picks the inverse CDF on the CPU and, on CUDA, the fused
kernel where the batch allows it, else the race; this prints each on the device you name, so the choice
can be checked on new hardware.

    python benchmarks/sampler.py --device cpu --rows 64 --vocab 512
    python benchmarks/sampler.py --device cuda --rows 256 --vocab 151936

Measured: CPU (2 cores, 1 thread, 64 x 512) race 0.55-0.64 ms, inverse CDF 0.26-0.33 ms; H200
(256 x 151936, bf16 logits) race 0.66 ms, inverse CDF 0.92 ms, fused 0.078 ms (0.16-0.22 ms with the
earlier one-pass Gumbel-max kernel).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from relax.backends.inference.embedded.sampling import fused_sampling
from relax.backends.inference.embedded.sampling.sampling import BatchSampler, RowParams, make_generator


def time_method(method: str, logits: torch.Tensor, iters: int) -> float:
    """Mean seconds per `sample()` of a temperature-1 batch with `method`."""
    device = logits.device
    sampler = BatchSampler([RowParams(1.0, 1.0, -1, 0.0, None)] * logits.shape[0], device, method)
    gen = make_generator(0, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(5):
        sampler.sample(logits, gen)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        sampler.sample(logits, gen)
    sync()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    logits = 3 * torch.randn(a.rows, a.vocab, device=device, dtype=dtype)
    out = {"device": a.device, "rows": a.rows, "vocab": a.vocab}
    methods = ["race", "inverse_cdf"] + (
        ["fused"] if device.type == "cuda" and fused_sampling.available() else []
    )
    for method in methods:
        out[f"{method}_ms"] = round(1e3 * time_method(method, logits, a.iters), 3)
    out["race_over_inverse_cdf"] = round(out["race_ms"] / out["inverse_cdf_ms"], 2)
    if "fused_ms" in out:
        out["race_over_fused"] = round(out["race_ms"] / out["fused_ms"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
