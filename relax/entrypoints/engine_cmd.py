"""`relax engine serve`: run one embedded inference engine behind its SGLang-compatible HTTP server until
SIGINT or SIGTERM, then end in-flight requests (finish reason abort) and exit 0.

    relax engine serve --model DIR --host 127.0.0.1 --port 30000 [--dtype bfloat16] [--max-running 64]

Every route but `/health` asks for `Authorization: Bearer KEY` when a key is given (`--api-key` or
`RELAX_API_KEY`); a non-loopback `--host` without one is refused unless `--insecure-no-auth`.

The main CLI calls `add_engine_parser(subparsers)`; the chosen command is `args.func(args) -> int`.
`python -m relax.entrypoints.engine_cmd serve ...` works without the main CLI.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any

from relax.data.reasoning import REASONING_PARSERS

logger = logging.getLogger(__name__)


def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    """`--api-key` and `--insecure-no-auth` of the standalone servers (relax/utils/auth.py `server_key`)."""
    parser.add_argument(
        "--api-key",
        default=None,
        help="Bearer token every route but /health requires (default: $RELAX_API_KEY; prefer the variable, "
        "a command line is visible to other users of the machine). Needed for a non-loopback --host.",
    )
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="Allow a non-loopback --host without an API key (every client that reaches it is trusted).",
    )


def add_engine_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `engine serve` to a `parser.add_subparsers()` object."""
    engine = subparsers.add_parser("engine", help="Run an embedded inference engine server.")
    sub = engine.add_subparsers(dest="engine_command", required=True)
    serve = sub.add_parser("serve", help="Serve a model over the SGLang-compatible HTTP protocol.")
    serve.add_argument(
        "--model", required=True, help="Hugging Face model folder (config.json + safetensors)."
    )
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    serve.add_argument("--port", type=int, default=30000, help="Port to listen on (0 = any free port).")
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if present).")
    serve.add_argument("--max-running", type=int, default=64, help="Max sequences decoded together.")
    serve.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV cache ceiling in tokens; the cache grows up to it (default: --kv-memory-fraction of the GPU's "
        "memory, 262144 on the CPU).",
    )
    serve.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=0.25,
        help="Without --max-total-tokens, the share of the GPU's memory the KV cache may grow to.",
    )
    serve.add_argument(
        "--disable-prefix-cache",
        "--disable-radix-cache",  # SGLang's name for it
        action="store_true",
        help="Do not reuse the KV of prompt prefixes across requests (the prefix cache).",
    )
    serve.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="Prefill tokens per engine step: a longer prompt is prefilled in chunks, the running requests "
        "decoding between them (as SGLang's flag; default 8192 on a GPU, 512 on the CPU; -1 or 0: off).",
    )
    serve.add_argument("--max-context-len", type=int, default=None, help="Cap on prompt + output tokens.")
    serve.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU).")
    serve.add_argument("--seed", type=int, default=None, help="Seed of requests without a sampling_seed.")
    serve.add_argument("--weight-version", default="0", help="Weight version reported until an update.")
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="Split the <think> block of /v1 chat replies into reasoning_content (as SGLang's flag): "
        "qwen3 (the model opens the block) or deepseek-r1 (the prompt opens it).",
    )
    add_auth_arguments(serve)
    serve.set_defaults(func=serve_command)
    return engine


def serve_command(args: argparse.Namespace) -> int:
    from relax.backends.inference.embedded.http.server import EngineServer
    from relax.utils.auth import server_key
    from relax.utils.gc_freeze import freeze_startup_objects

    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        logger.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    api_key = server_key(args.api_key, args.host, args.insecure_no_auth, "relax engine serve")
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    server = EngineServer(
        args.model,
        host=args.host,
        port=args.port,
        api_key=api_key,
        dtype=args.dtype,
        device=args.device,
        max_running=args.max_running,
        max_total_tokens=args.max_total_tokens,
        kv_memory_fraction=args.kv_memory_fraction,
        enable_prefix_cache=not args.disable_prefix_cache,
        chunked_prefill_size=args.chunked_prefill_size,
        max_context_len=args.max_context_len,
        threads=args.threads,
        seed=args.seed,
        weight_version=args.weight_version,
        reasoning_parser=args.reasoning_parser,
    )
    try:
        server.start()
        freeze_startup_objects()  # a serving process: see relax/utils/gc_freeze.py
        logger.info("relax engine ready at %s", server.url)
        while not stop.wait(timeout=1.0):
            pass
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def main(argv: list[str] | None = None) -> int:
    from relax.utils.logging import setup_logging

    setup_logging()
    parser = argparse.ArgumentParser(prog="relax")
    add_engine_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["engine", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
