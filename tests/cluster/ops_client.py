"""What an operator does against a run on the simulated cluster, run as a process on one of its hosts:
`python -m tests.cluster.ops_client scale_out RUN_DIR N` (waits until the operation ends, prints it) and
`python -m tests.cluster.ops_client engines RUN_DIR` (prints the engine list). Output: one JSON line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx

from relax.utils.auth import auth_headers, read_run_token


def api(run_dir: str) -> str:
    return json.loads((Path(run_dir) / "endpoints.json").read_text())["elastic_api"]


def scale_out(run_dir: str, n: int, timeout_s: float = 300) -> dict:
    url = api(run_dir)
    headers = auth_headers(read_run_token(run_dir))
    body = {"mode": "ray_native", "num_engines": n}
    op = httpx.post(f"{url}/v1/engines/scale_out", json=body, timeout=30, headers=headers)
    op.raise_for_status()
    op_id = op.json()["request_id"]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = httpx.get(f"{url}/v1/operations/{op_id}", timeout=30, headers=headers).json()
        if state["done"]:
            return state
        time.sleep(0.5)
    raise TimeoutError(f"scale-out {op_id} still running after {timeout_s}s")


def engines(run_dir: str) -> dict:
    return httpx.get(
        f"{api(run_dir)}/v1/engines", timeout=30, headers=auth_headers(read_run_token(run_dir))
    ).json()


if __name__ == "__main__":
    verb, run_dir, *rest = sys.argv[1:]
    out = scale_out(run_dir, int(rest[0])) if verb == "scale_out" else engines(run_dir)
    print(json.dumps(out))
