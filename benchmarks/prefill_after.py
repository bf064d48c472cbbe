"""The prefill past cached prefixes (`ModelRunner.prefill_after`), packed against masked, and the plain
prefill of the same new tokens as a yardstick. Not a test.

U rows each hold a cached prefix of `--prefix` tokens and prefill `--suffix` new ones (an agent turn's
tool observation after its history): the packed path (`packed_prefill.py`: one variable-length flash call
per layer over exactly each row's columns) and the masked one (rows padded to the longest, a dense mask,
repeated key/value heads) are timed on the same rows, then a plain causal prefill of U prompts of
`--suffix` tokens (no prefix to attend to). Printed: milliseconds and new tokens per second of each, and
the attention FLOPs of the packed call against 989 TFLOP/s (the H200's dense bf16 datasheet figure);
`--profile` adds each path's top CUDA kernels. The last line printed is one JSON object.

    python benchmarks/prefill_after.py --preset qwen2.5-0.5b --rows 32 --prefix 3584 --suffix 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from relax.backends.inference.embedded.model.runner import ModelRunner

BF16_FLOPS = 989e12  # H200 SXM datasheet dense bf16


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() over `repeats` runs after one untimed."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def profile(fn, label: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    print(f"== {label}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    ap.add_argument("--device", default="cuda", help="cuda (the CPU only checks that it runs: float32)")
    ap.add_argument("--rows", type=int, default=32, help="Rows prefilled together.")
    ap.add_argument("--prefix", type=int, default=3584, help="Cached tokens of each row.")
    ap.add_argument("--suffix", type=int, default=512, help="New tokens of each row.")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="Print each path's top CUDA kernels.")
    args = ap.parse_args()
    from engine import PRESETS, write_model  # benchmarks/engine.py, beside this script

    with tempfile.TemporaryDirectory() as tmp:
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        model_dir = write_model(args.preset, dtype, Path(tmp) / "model")
        runner = ModelRunner(str(model_dir), device=args.device, dtype=dtype, cuda_graphs=False)
    U, P, T = args.rows, args.prefix, args.suffix
    cache = runner.cache
    cache.set_budget(2 * U * (P + T) + 1024)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, 50000, (U, P + T), generator=gen).tolist()
    for u in range(U):  # every row holds its whole prompt's blocks; the prefix's KV is written once
        assert cache.extend(u, P + T)
    runner.prefill([p[:P] for p in prompts], list(range(U)))
    suffixes, rows, starts = [p[P:] for p in prompts], list(range(U)), [P] * U
    packed = runner.packed_prefill
    results = {}

    def run(on: bool):
        def fn():
            runner.packed_prefill = on
            runner.prefill_after(suffixes, rows, starts)

        return fn

    def plain():
        runner.prefill(suffixes, rows)

    paths = {"packed": run(True), "masked": run(False), "plain": plain} if packed else {"masked": run(False)}
    for name, fn in paths.items():
        ms = timed(fn, args.repeats)
        results[name] = {"ms": round(ms, 2), "new_tok_s": round(U * T / ms * 1e3)}
        print(f"{name}: {ms:.2f} ms, {U * T / ms * 1e3:,.0f} new tokens/s", flush=True)
        if args.profile:
            profile(fn, name)
    cfg = PRESETS[args.preset]
    L, Hq, D = (
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["hidden_size"] // cfg["num_attention_heads"],
    )
    # causal past a prefix: query t of a row sees P + t + 1 keys; QK and PV are 2 FLOPs each per pair
    attn_flops = 4 * L * Hq * D * U * sum(P + t + 1 for t in range(T))
    result = {
        "preset": args.preset,
        "rows": U,
        "prefix": P,
        "suffix": T,
        **results,
        "attention_tflop": round(attn_flops / 1e12, 2),
        "attention_floor_ms": round(attn_flops / BF16_FLOPS * 1e3, 2),
        "basis": "H200 datasheet: 989 TFLOP/s dense bf16",
    }
    if "packed" in results and "masked" in results:
        result["packed_vs_masked"] = round(results["masked"]["ms"] / results["packed"]["ms"], 2)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
