"""The training forward's attention, forward and backward, through each SDPA backend at the trainer's shapes.

The trainer's micro-batches are right-padded [B, L] blocks without a mask, so `transformers`' SDPA path
calls `scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)` once per layer; which
kernel runs is the backend torch picks (flash first by default on CUDA). This script times that call,
forward alone and forward + backward, for each backend that accepts it, at the micro-batch shapes of
the RL step (`--shape`), and prints TFLOP/s of the causal attention (QK^T and PV: 4 B H L^2 D / 2 a
forward; the backward 2.5x that, as flash attention's recompute counts it) against the H200's public
dense bf16 peak of 989 TFLOP/s, and each backend's largest difference from the first one's output and
gradients:

    python benchmarks/train_attention.py                   # CUDA: every shape, every backend
    python benchmarks/train_attention.py --device cpu --shape tiny
    python benchmarks/train_attention.py --plan-cost

`--plan-cost`: the first forward + backward of each of a few new (rows, length) shapes against its third,
per backend: what a backend spends setting up a shape it has not met (cuDNN builds an execution plan).

The last line printed is a JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

PEAK_FLOPS = 989e12  # H200 dense bf16, the public datasheet basis
SHAPES = {  # name: (rows B, query heads, kv heads, tokens L, head dim): one micro-batch of the RL step
    "0.5b-2k": (16, 14, 2, 2176, 64),  # 34,816 tokens: 128-token prompts + 2,048-token responses
    "0.5b-256": (170, 14, 2, 384, 64),  # the 256-token step's 65,536-token micro-batch
    "0.5b-8k": (4, 14, 2, 8320, 64),
    "1.5b-2k": (16, 12, 2, 2176, 128),
    "tiny": (2, 4, 2, 64, 16),
}
BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def causal_flops(B: int, H: int, L: int, D: int) -> float:
    """FLOPs of one causal forward (QK^T and PV over the lower triangle)."""
    return 4.0 * B * H * L * L * D / 2


def _timer(device: torch.device):
    if device.type == "cuda":

        def run(fn, reps: int) -> list[float]:
            out = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                out.append(a.elapsed_time(b) / 1e3)
            return out

        return run

    def run_cpu(fn, reps: int) -> list[float]:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    return run_cpu


def bench_shape(name: str, backends: list[str], device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    B, Hq, Hkv, L, D = SHAPES[name]
    g = torch.Generator(device=device).manual_seed(0)

    def leaf(h: int) -> torch.Tensor:
        return torch.randn(B, h, L, D, device=device, dtype=dtype, generator=g).requires_grad_()

    q, k, v = leaf(Hq), leaf(Hkv), leaf(Hkv)
    dout = torch.randn(B, Hq, L, D, device=device, dtype=dtype, generator=g)
    timer = _timer(device)
    fwd_flops = causal_flops(B, Hq, L, D)
    res: dict = {"shape": [B, Hq, Hkv, L, D], "tokens": B * L}
    ref = None
    for be, gqa in [(b, g) for b in backends for g in (True, False)]:
        label = be if gqa else f"{be}+repeat_kv"
        if not gqa and be in res and "error" not in res[be]:
            continue  # the kv heads repeated (transformers' path where SDPA refuses GQA) only as a fallback
        row: dict = {}

        def attend(gqa: bool = gqa):
            if gqa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            rep = Hq // Hkv
            return F.scaled_dot_product_attention(
                q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True
            )

        def fwd():
            with torch.no_grad():
                return attend()

        def fwd_bwd():
            q.grad = k.grad = v.grad = None
            out = attend()
            out.backward(dout)
            return out

        try:
            with sdpa_kernel(BACKENDS[be]):
                out = fwd_bwd()  # warm-up, and the values compared below
                got = [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]
                timer(fwd, 2)
                f_s = statistics.median(timer(fwd, reps))
                fb_s = statistics.median(timer(fwd_bwd, reps))
        except RuntimeError as e:  # the backend refuses this shape, dtype or device
            res[label] = {"error": str(e).splitlines()[0][:200]}
            continue
        row["fwd_ms"], row["fwd_bwd_ms"] = 1e3 * f_s, 1e3 * fb_s
        row["bwd_ms"] = 1e3 * (fb_s - f_s)
        row["fwd_tflops"] = fwd_flops / f_s / 1e12
        row["fwd_bwd_tflops"] = 3.5 * fwd_flops / fb_s / 1e12
        if device.type == "cuda":
            row["fwd_bwd_of_peak"] = 3.5 * fwd_flops / fb_s / PEAK_FLOPS
        if ref is None:
            ref = got
            res["reference"] = label
        else:
            for what, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True):
                row[f"max_abs_{what}"] = float((a - b).abs().max())
        res[label] = row
    return res


PLAN_SHAPES = [(16, 2176), (16, 2168), (15, 2176), (170, 384), (168, 392), (33, 1000), (40, 800), (8, 4096)]


def plan_cost(backend: str, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """First and third fwd+bwd seconds of each shape of `PLAN_SHAPES` (0.5B heads), met in this order."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    with sdpa_kernel(BACKENDS[backend]):
        for B, L in [(4, 512), *PLAN_SHAPES]:  # the first one warms the backend up
            # [B, L, H, D] transposed, as transformers' projections give them
            q, k, v = (
                torch.randn(B, L, h, 64, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
                for h in (14, 2, 2)
            )
            times = []
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.125)
                o.sum().backward()
                sync()
                times.append(time.perf_counter() - t0)
            out.append({"rows": B, "tokens": L, "first_ms": 1e3 * times[0], "third_ms": 1e3 * times[2]})
    return out[1:]


def print_plan_cost(backends: list[str], device: torch.device, dtype: torch.dtype) -> None:
    result: dict = {"device": str(device)}
    for be in backends:
        rows = result[be] = plan_cost(be, device, dtype)
        for r in rows:
            print(
                f"{be:6s} {r['rows']:4d} x {r['tokens']:5d}: first {r['first_ms']:8.1f} ms, third {r['third_ms']:6.1f} ms"
            )
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument(
        "--shape", action="append", choices=sorted(SHAPES), help="repeatable; default: all but tiny"
    )
    p.add_argument("--backend", action="append", choices=list(BACKENDS), help="repeatable; default: all")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--plan-cost", action="store_true", help="time each backend's first call of new shapes")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shapes = args.shape or [s for s in SHAPES if s != "tiny"]
    backends = args.backend or (list(BACKENDS) if device.type == "cuda" else ["math", "flash"])
    if device.type == "cuda" and not args.backend:
        backends.remove("math")  # [B, H, L, L] scores: tens of GB at these shapes
    if args.plan_cost:
        return print_plan_cost(
            args.backend or (["cudnn", "flash"] if device.type == "cuda" else ["flash"]), device, dtype
        )
    result = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "peak_tflops": PEAK_FLOPS / 1e12,
    }
    for name in shapes:
        r = result[name] = bench_shape(name, backends, device, dtype, args.reps)
        for be, row in r.items():
            if not isinstance(row, dict):
                continue
            if "error" in row:
                print(f"{name:9s} {be:19s} refused: {row['error']}")
                continue
            peak = f" ({row['fwd_bwd_of_peak']:.1%} of 989)" if "fwd_bwd_of_peak" in row else ""
            diff = (
                f"  max |d out| {row['max_abs_out']:.2e}, |d dq| {row['max_abs_dq']:.2e}"
                if "max_abs_out" in row
                else ""
            )
            print(
                f"{name:9s} {be:19s} fwd {row['fwd_ms']:8.3f} ms ({row['fwd_tflops']:6.1f} TFLOP/s)  "
                f"fwd+bwd {row['fwd_bwd_ms']:8.3f} ms ({row['fwd_bwd_tflops']:6.1f} TFLOP/s{peak}){diff}"
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
