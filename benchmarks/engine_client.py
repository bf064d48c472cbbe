"""CPU cost of the engine client's HTTP transport: httpx against aiohttp, on the same `/generate` requests
to a real `relax engine serve` process on 127.0.0.1 (tiny model, one new token, so the server answers
quickly). The Rollout replica sends every sample through this client; on 2 cores its CPU time is taken
from the engines and the trainer. Not a test.

    python benchmarks/engine_client.py                  # 2000 requests, 64 at a time, 3 rounds each

Prints, per transport, the client process's CPU seconds per 1000 requests (`time.process_time`) and
requests per second (median of the rounds, run alternately), and the ratio httpx / aiohttp.
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

import aiohttp
import httpx

BODY = {
    "input_ids": [5, 6, 7, 8, 9, 10, 11, 12],
    "sampling_params": {"max_new_tokens": 1},
    "return_logprob": True,
}


async def _run_httpx(url: str, n: int, conc: int) -> None:
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one() -> None:
            r = await client.post("/generate", json=BODY)
            r.raise_for_status()
            r.json()

        await _bounded(one, n, conc)


async def _run_aiohttp(url: str, n: int, conc: int) -> None:
    connector = aiohttp.TCPConnector(limit=conc)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(60)) as session:

        async def one() -> None:
            async with session.post("/generate", json=BODY) as r:
                r.raise_for_status()
                json.loads(await r.read())

        await _bounded(one, n, conc)


async def _bounded(one, n: int, conc: int) -> None:
    sem = asyncio.Semaphore(conc)

    async def guarded() -> None:
        async with sem:
            await one()

    await asyncio.gather(*(guarded() for _ in range(n)))


def measure(kind: str, url: str, n: int, conc: int) -> tuple[float, float]:
    """(client CPU seconds per 1000 requests, requests per second)."""
    run = _run_httpx if kind == "httpx" else _run_aiohttp
    cpu0, t0 = time.process_time(), time.perf_counter()
    asyncio.run(run(url, n, conc))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    return 1000 * cpu / n, n / wall


def start_engine(model_dir: Path) -> tuple[subprocess.Popen, str]:
    port = 30000 + os.getpid() % 20000
    cmd = [sys.executable, "-m", "relax.entrypoints.engine_cmd", "serve", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the engine at {url} did not come up in 120 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    from relax.models.tiny import write_tiny_model

    model = write_tiny_model(Path(tempfile.mkdtemp(prefix="relax-client-bench-")) / "model")
    proc, url = start_engine(model)
    try:
        measure("httpx", url, 200, args.concurrency)  # warm-up: both transports, the server's first requests
        measure("aiohttp", url, 200, args.concurrency)
        results: dict[str, list[tuple[float, float]]] = {"httpx": [], "aiohttp": []}
        for _ in range(args.rounds):
            for kind in results:
                results[kind].append(measure(kind, url, args.requests, args.concurrency))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    med = {
        k: (statistics.median(c for c, _ in v), statistics.median(r for _, r in v))
        for k, v in results.items()
    }
    print(f"{args.requests} requests, {args.concurrency} at a time, {args.rounds} rounds (medians)")
    for kind, (cpu, rps) in med.items():
        print(f"{kind:<8} client CPU {cpu:6.3f} s / 1000 requests   {rps:7.1f} requests/s")
    print(
        f"httpx / aiohttp: CPU {med['httpx'][0] / med['aiohttp'][0]:.2f}x, "
        f"time {med['aiohttp'][1] / med['httpx'][1]:.2f}x"
    )


if __name__ == "__main__":
    main()
