"""Bad input on a running engine: how fast each is refused, whether a request in flight beside it is
served, and where the server's memory is afterwards.

Starts `relax engine serve` (a tiny random Qwen2 on CPU, loopback) in its own process, then for each bad
input of issue 43 (non-finite or huge `logit_bias`, a backtracking stop regex, a lone surrogate, a text
of 51 MB, a half-sent request, `stop_token_ids` outside the vocabulary) sends it while a normal
generation runs, and prints: the answer's status, the seconds to it, the normal request's status, and the
server's resident memory (VmRSS) before and after, as a ratio. The promise: a 4xx within 1 s (the stop
regex, valid input, is served: 200 after its 200 tokens, in linear time), the neighbour 200, memory back
within 10%.

    python benchmarks/engine_bad_input.py [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

NORMAL = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 32, "ignore_eos": True}}
BIG_TEXT_MB = 51


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cases() -> list[tuple[str, str, Any]]:
    sp = {"max_new_tokens": 200, "ignore_eos": True}
    big = "hello world " * (BIG_TEXT_MB * 1024 * 1024 // 12)
    return [
        ("logit_bias 1e300", "/generate", b'{"input_ids":[1,2],"sampling_params":{"logit_bias":{"5":1e300}}}'),
        ("logit_bias NaN", "/generate", b'{"input_ids":[1,2],"sampling_params":{"logit_bias":{"5":NaN}}}'),
        ("logit_bias 3e38, T=1e-5", "/generate",
         {"input_ids": [1, 2], "sampling_params": {"logit_bias": {"5": 3e38}, "temperature": 1e-5}}),
        ("logit_bias via /v1 chat", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1e300}}),
        ("stop_regex (.*a){20}$", "/generate",
         {"text": "a" * 50, "sampling_params": {**sp, "stop_regex": "(.*a){20}$"}}),
        ("lone surrogate /generate", "/generate", b'{"text": "a\\ud800b"}'),
        ("lone surrogate /v1 chat", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'),
        (f"{BIG_TEXT_MB} MB text", "/generate", {"text": big}),
        ("stop_token_ids outside vocab", "/generate",
         {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [10**9]}}),
    ]  # fmt: skip


def send(url: str, path: str, body: Any) -> tuple[int, float]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    t0 = time.perf_counter()
    r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=600)
    return r.status_code, time.perf_counter() - t0


def half_sent(host: str, port: int) -> tuple[int, float]:
    """Headers cut in the middle: the server's header timeout answers (408/431) or closes."""
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=120) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Ty")
        answer = sock.recv(4096).decode(errors="replace")
    status = int(answer.split()[1]) if answer.startswith("HTTP/") else 0
    return status, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model folder (default: a tiny random Qwen2 written to a temp folder)")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="relax-bad-input-"))
    model = args.model
    if model is None:
        from relax.models.tiny import write_tiny_model

        model = str(write_tiny_model(tmp / "model", family="qwen2"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "relax", "engine", "serve", "--model", model, "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp / "server.log", "w"))
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        send(url, "/generate", NORMAL)  # warm
        base = rss_mb(server.pid)
        print(f"engine pid {server.pid}, resident {base:.0f} MB after a warm-up request")
        print(f"{'input':32} {'status':>6} {'s to answer':>11} {'beside it':>9} {'RSS after/before':>16}")
        ok = True
        rows = [(name, path, body) for name, path, body in cases()] + [("half-sent headers", "", None)]
        for name, path, body in rows:
            with ThreadPoolExecutor(2) as pool:
                normal = pool.submit(send, url, "/generate", NORMAL)
                time.sleep(0.05)
                status, took = half_sent("127.0.0.1", port) if body is None else send(url, path, body)
                neighbour = normal.result()[0]
            time.sleep(0.5)  # the trim after a big body runs once its response has gone out
            ratio = rss_mb(server.pid) / base
            # a stop regex is valid input: RE2 matches it in linear time, so it is served (200) like any
            # other request of 200 tokens; a half-sent request waits for the header timeout
            served = name.startswith("stop_regex")
            fast = took < 1.0 or body is None or served
            answer_ok = status == 200 if served else 400 <= status < 500
            good = answer_ok and neighbour == 200 and ratio < 1.10 and fast
            ok &= good
            print(
                f"{name:32} {status:>6} {took:>11.3f} {neighbour:>9} {ratio:>16.3f}{'' if good else '  <--'}"
            )
        print(
            "every bad input refused with a 4xx, its neighbour served, memory within 10%" if ok else "MISSED"
        )
        return 0 if ok else 1
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
