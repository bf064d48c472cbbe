"""`relax engine serve` as a real process: it serves, then exits cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import httpx
from engine_helpers import free_port

from relax.entrypoints.engine_cmd import add_engine_parser


def test_parser_builds_the_serve_command():
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["engine", "serve", "--model", "m", "--port", "0", "--max-running", "4"])
    assert args.model == "m" and args.port == 0 and args.max_running == 4 and callable(args.func)


def test_serve_until_sigterm(bare_model_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "relax.entrypoints.engine_cmd", "serve", "--model", str(bare_model_dir)]
    cmd += ["--port", str(port), "--threads", "1", "--dtype", "float32"]
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "engine did not come up"
            time.sleep(0.2)
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
        assert len(httpx.post(url + "/generate", json=body, timeout=30).json()["output_ids"]) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
