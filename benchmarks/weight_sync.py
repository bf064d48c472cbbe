"""Weight-sync time from a trainer process to an embedded engine process, per transport, in one run.

The trainer is this process (the model on cuda:0); engines are `relax engine serve` processes on cuda:0
(the trainer's GPU: colocate, or ActorFwd beside the trainer) and, with two GPUs, on cuda:1, each seeing
only its own GPU as under Ray. Every
transport publishes the same weights through `WeightPublisher`, as the trainer does each step:

    gloo/tensor   gloo group, one broadcast per tensor, through host memory (the old same-GPU path)
    nccl/tensor   NCCL group, one broadcast per tensor (SGLang's protocol)
    nccl/flat     NCCL group, one broadcast per packed bucket
    ipc           CUDA IPC handle of the packed bucket to the engine on the trainer's GPU

    python benchmarks/weight_sync.py                          # Qwen2.5-0.5B shape, bf16 (GPU host)
    python benchmarks/weight_sync.py --tiny --repeats 3       # CPU smoke run: gloo only

prints the median seconds per publish (after one warm-up publish) and the ratio to gloo/tensor; the last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

QWEN25_05B = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936}  # fmt: skip


def start_engine(model: Path, device: str, port: int, log: Path | None = None) -> subprocess.Popen:
    """An engine process that sees only its GPU, as under Ray (GPUs are matched by UUID, not index)."""
    cmd = [sys.executable, "-m", "relax.entrypoints.engine_cmd", "serve", "--model", str(model)]
    cmd += ["--port", str(port), "--max-total-tokens", "16384", "--max-running", "8"]
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = str(torch.device(device).index or 0)
        device = "cuda:0"
    cmd += ["--device", device]
    out = log.open("w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine on {device} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"engine on {device} did not answer within 300 s")


async def measure(url: str, named, repeats: int, bucket_mb: int, **kw) -> list[float]:
    from relax.weights.publisher import WeightPublisher
    from relax.weights.sender import send_weights

    pub = WeightPublisher(bucket_mb << 20, group_name=f"bench_{time.monotonic_ns()}", **kw)
    await pub.connect([url])
    try:
        times = []
        for v in range(repeats + 1):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append((await send_weights(pub, named, version=v + 1))["perf/weight_publish_s"])
        return times[1:]
    finally:
        await pub.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bucket-mb", default="256,1024", help="bucket sizes to try (MiB, comma separated)")
    p.add_argument("--tiny", action="store_true", help="the tiny test model (CPU smoke run)")
    p.add_argument("--engine-logs", default=None, help="folder for the engines' output (default: dropped)")
    p.add_argument("--only", default="", help="comma-separated transport prefixes to run (default: all)")
    args = p.parse_args()
    from relax.models.tiny import write_tiny_model
    from relax.models.tokenizer import train_tiny_tokenizer
    from relax.utils.net import free_port

    gpus = torch.cuda.device_count()
    tmp = Path(tempfile.mkdtemp(prefix="relax-wsync-"))
    if args.tiny:
        model_dir = write_tiny_model(tmp / "model", family="qwen2", dtype="float32")
    else:
        model_dir = write_tiny_model(tmp / "model", family="qwen2", tokenizer=train_tiny_tokenizer(4096),
                                     dtype="bfloat16", **QWEN25_05B)  # fmt: skip
    from transformers import AutoModelForCausalLM

    trainer_device = "cuda:0" if gpus else "cpu"
    if gpus:
        torch.cuda.set_device(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(trainer_device)
    named = [(n, t.detach()) for n, t in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    print(
        f"{len(named)} tensors, {nbytes / 1e6:.0f} MB, trainer on {trainer_device}, {gpus} GPUs", flush=True
    )

    engines = {}
    try:
        logs = Path(args.engine_logs) if args.engine_logs else None
        for where, dev in [("same", trainer_device), ("other", "cuda:1")][: 2 if gpus >= 2 else 1]:
            port = free_port()
            log = logs / f"engine_{where}.log" if logs else None
            engines[where] = (start_engine(model_dir, dev, port, log), f"http://127.0.0.1:{port}")
        runs = [
            ("gloo/tensor", "same", 256, {"backend": "gloo", "flatten": False, "ipc": False}),
            ("gloo/flat", "same", 256, {"backend": "gloo", "force_flat": True, "ipc": False}),
        ]
        for mb in [int(x) for x in args.bucket_mb.split(",")]:
            if "other" in engines:
                runs.append((f"nccl/tensor/{mb}M", "other", mb, {"backend": "nccl", "flatten": False}))
                runs.append((f"nccl/flat/{mb}M", "other", mb, {"backend": "nccl", "flatten": True}))
            if gpus:
                runs.append((f"ipc/{mb}M", "same", mb, {"ipc": True}))
        if args.only:
            runs = [r for r in runs if r[0] == "gloo/tensor" or r[0].startswith(tuple(args.only.split(",")))]
        results = {}
        for name, where, mb, kw in runs:
            times = asyncio.run(measure(engines[where][1], named, args.repeats, mb, **kw))
            results[name] = statistics.median(times)
            print(f"{name:<20} {1e3 * results[name]:9.1f} ms  (min {1e3 * min(times):.1f})", flush=True)
    finally:
        for proc, _ in engines.values():
            proc.terminate()
            proc.wait(timeout=60)
    base = results["gloo/tensor"]
    print(f"\n{'transport':<20}{'ms':>9}{'x gloo':>9}{'GB/s':>8}")
    for name, s in results.items():
        print(f"{name:<20}{1e3 * s:>9.1f}{base / s:>9.1f}{nbytes / s / 1e9:>8.1f}")
    print(json.dumps({"bytes": nbytes, "tensors": len(named), "seconds": results}))


if __name__ == "__main__":
    main()
