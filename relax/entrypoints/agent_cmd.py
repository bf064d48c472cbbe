"""`relax agent serve`: the agent endpoint of external agents outside a training run, over a model folder
or checkpoint (an embedded engine in this process) or running engines (`--engine-url`), so an agent
program can be written and debugged before it trains (`relax.agentic.dev_server`).

    relax agent serve --model DIR [--port 8000] [--out agent_runs] [--engine-url http://127.0.0.1:30000]

Point any OpenAI client at http://127.0.0.1:8000/v1 (the session `default`) or .../s/<id>/v1; every call
is appended to `<out>/calls.jsonl`; at SIGINT/SIGTERM the sessions' trajectories go to
`<out>/trajectories.jsonl`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from relax.entrypoints.engine_cmd import add_auth_arguments

logger = logging.getLogger(__name__)


def add_agent_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `agent serve` to a `parser.add_subparsers()` object."""
    agent = subparsers.add_parser("agent", help="Develop an external agent against the agent endpoint.")
    sub = agent.add_subparsers(dest="agent_command", required=True)
    serve = sub.add_parser("serve", help="Serve a model behind the OpenAI-compatible agent endpoint.")
    serve.add_argument(
        "--model", required=True, help="Model folder or checkpoint (tokenizer, chat template, weights)."
    )
    serve.add_argument(
        "--engine-url", action="append", default=[],
        help="A running engine to generate on (repeatable); default: start an embedded engine over --model.",
    )  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1", help="Address the endpoint listens on.")
    serve.add_argument("--port", type=int, default=8000, help="Port of the endpoint (0 = any free port).")
    serve.add_argument("--out", default="agent_runs", help="Folder for calls.jsonl and trajectories.jsonl.")
    serve.add_argument(
        "--model-name", default=None, help="Model id the endpoint reports (default: the folder's name)."
    )
    serve.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="Behaviour policy temperature (a request may set its own).",
    )
    serve.add_argument("--top-p", type=float, default=1.0, help="Behaviour policy top_p.")
    serve.add_argument("--max-tokens", type=int, default=1024, help="Cap on one call's output tokens.")
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", default=None, help="Embedded engine: cpu, cuda or cuda:N.")
    serve.add_argument(
        "--engine-api-key", default=None, help="Bearer token of the --engine-url engines (default: none)."
    )
    add_auth_arguments(serve)
    serve.set_defaults(func=serve_command)
    return agent


def serve_command(args: argparse.Namespace) -> int:
    import secrets

    from relax.agentic.dev_server import AgentDevServer
    from relax.utils.auth import server_key

    api_key = server_key(args.api_key, args.host, args.insecure_no_auth, "relax agent serve")
    engine = None
    urls, engine_key = list(args.engine_url), args.engine_api_key
    if not urls:  # an engine of its own on loopback, behind a key only this process knows
        from relax.backends.inference.embedded.http.server import EngineServer

        engine_key = secrets.token_urlsafe(24)
        engine = EngineServer(args.model, port=0, dtype=args.dtype, device=args.device, api_key=engine_key)
        engine.start()
        urls = [engine.url]
    try:
        dev = AgentDevServer(
            args.model, urls, args.out, host=args.host, port=args.port, model_name=args.model_name,
            defaults={"temperature": args.temperature, "top_p": args.top_p}, max_tokens=args.max_tokens,
            api_key=api_key, engine_api_key=engine_key,
        )  # fmt: skip
        asyncio.run(_serve(dev))
    finally:
        if engine is not None:
            engine.stop()
    return 0


async def _serve(dev: Any) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, stop.set)
    await dev.run(stop)


def main(argv: list[str] | None = None) -> int:
    from relax.utils.logging import setup_logging

    setup_logging()
    parser = argparse.ArgumentParser(prog="relax")
    add_agent_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["agent", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
