"""`relax agent serve` as a real process over a model folder: an `openai` client talks to the default
session and to a named one, the calls are written to calls.jsonl as they happen, a session's
trajectories can be read while it runs, and at SIGTERM the process writes trajectories.jsonl and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_agent_serve_records_sessions(tiny_model_dir, tmp_path):
    port = _free_port()
    out = tmp_path / "agent_runs"
    cmd = [sys.executable, "-m", "relax.entrypoints.agent_cmd", "serve", "--model", str(tiny_model_dir),
           "--port", str(port), "--out", str(out), "--dtype", "float32", "--max-tokens", "8"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "agent serve did not come up"
            time.sleep(0.3)
        plain = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        first = plain.chat.completions.create(model="m", messages=msgs, max_tokens=4)
        msgs += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        plain.chat.completions.create(model="m", messages=msgs, max_tokens=4)  # continues the first call
        named = openai.OpenAI(base_url=url + "/s/abc/v1", api_key="x", max_retries=0)
        streamed = named.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "yo"}], stream=True
        )
        assert list(streamed)
        calls = [json.loads(x) for x in (out / "calls.jsonl").read_text().splitlines()]
        assert [(c["session"], c["call"], c["parent"]) for c in calls] == [
            ("default", 0, None),
            ("default", 1, 0),
            ("abc", 0, None),
        ]
        (traj,) = httpx.get(url + "/s/default/trajectories", timeout=10).json()
        assert traj["calls"] == [0, 1] and sum(traj["loss_mask"]) == len(calls[0]["output_ids"]) + len(
            calls[1]["output_ids"]
        )
        sessions = {s["session"]: s["calls"] for s in httpx.get(url + "/sessions", timeout=10).json()}
        assert sessions == {"default": 2, "abc": 1}
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0, proc.stdout.read()
    rows = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(r["session"] for r in rows) == ["abc", "default"]
