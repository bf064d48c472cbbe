"""`relax engine serve` as a real process: it serves, then exits cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import signal

import httpx

from relax.entrypoints.engine_cmd import add_engine_parser
from tests.engine_helpers import engine_process


def test_parser_builds_the_serve_command():
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["engine", "serve", "--model", "m", "--port", "0", "--max-running", "4"])
    assert args.model == "m" and args.port == 0 and args.max_running == 4 and callable(args.func)
    assert not args.disable_prefix_cache
    for flag in ("--disable-prefix-cache", "--disable-radix-cache"):  # ours and SGLang's name
        assert parser.parse_args(["engine", "serve", "--model", "m", flag]).disable_prefix_cache


def test_serve_until_sigterm(bare_model_dir):
    proc, url = engine_process(bare_model_dir, "--threads", "1")
    try:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
        assert len(httpx.post(url + "/generate", json=body, timeout=30).json()["output_ids"]) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
