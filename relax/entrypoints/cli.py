"""The `relax` command line: train, eval, config, tiny-model, data, doctor, engine, agent, export,
status, examples; `relax --version`. `python -m relax` is the same command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from relax.utils.logging import setup_logging

logger = logging.getLogger("relax")


def cmd_train(args: argparse.Namespace) -> int:
    from relax.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"relax train: {e}", file=sys.stderr)
        return 2
    from relax.data.dataset import DataError
    from relax.entrypoints.signals import exit_after_stop, stop_on_signals
    from relax.orchestration.checkpoint import CheckpointError
    from relax.orchestration.controller import Controller
    from relax.orchestration.preflight import PreflightError
    from relax.orchestration.service import RoleStartError, RunStopped
    from relax.orchestration.stop import StopRequest
    from relax.utils.hub import HubError

    try:
        # SIGTERM / Ctrl-C: the first asks the run to stop, the second stops at once (KeyboardInterrupt)
        # (once the run ended on a stop, a further signal ends the process at once: Ray's shutdown at exit
        # may take seconds)
        with stop_on_signals(StopRequest(), for_the_process=True) as stop:
            step = Controller(cfg, resume=args.resume, stop=stop).run()
    # HubError, DataError: a Hub model or data set the driver cannot resolve or read (before Ray starts)
    except (PreflightError, RoleStartError, CheckpointError, FileExistsError, HubError, DataError) as e:
        print(f"relax train: {e}", file=sys.stderr)
        return 1
    except RunStopped as e:
        print(f"relax train: {e}", file=sys.stderr)
        exit_after_stop(130)
    except KeyboardInterrupt:  # the second SIGTERM / Ctrl-C: the run stopped at once
        print(
            "relax train: stopped at once by a second signal (no checkpoint of the step in flight)",
            file=sys.stderr,
        )
        # Exit now: after an interrupted clean-up, Ray's threads may still be tearing down, and the
        # interpreter's own exit beside them crashed (SIGSEGV) or waited on them.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    logger.info("done at step %d; run folder: %s", step, cfg.run.run_dir)
    if stop.requested:  # the run ended on a stop signal: exit with its handlers on (signals.py)
        exit_after_stop(0)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from relax.config import ConfigError, load_config
    from relax.orchestration.eval_only import run_eval

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"relax eval: {e}", file=sys.stderr)
        return 2
    metrics = run_eval(cfg, args.checkpoint)
    for k, v in sorted(metrics.items()):
        print(f"{k:40s} {v:.4f}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config (defaults filled in) or every field with its description."""
    import yaml

    from relax.config import ConfigError, RelaxConfig, load_config

    if args.describe:
        for line in _describe(RelaxConfig):
            print(line)
        return 0
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"relax config: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _describe(model, prefix: str = "") -> list[str]:
    from pydantic import BaseModel

    lines = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines += _describe(ann, f"{prefix}{name}.")
        else:
            default = (
                "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
            )
            lines.append(f"{prefix}{name} = {default}  # {field.description or ''}")
    return lines


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from relax.models.tiny import count_parameters, write_tiny_model

    path = write_tiny_model(
        args.out,
        family=args.family,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        init_std=args.init_std,
    )
    from relax.models.multimodal_model import load_causal_lm

    n = count_parameters(load_causal_lm(path))
    print(f"wrote tiny {args.family} model ({n / 1e6:.2f} M parameters) to {path}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from relax.data.toy import generate_arith

    if args.task in ("colors", "tones"):
        from relax.data.toy_media import generate_colors, generate_tones

        gen = generate_colors if args.task == "colors" else generate_tones
        path = gen(args.out, n=args.n, seed=args.seed, inline=args.inline)
        print(f"wrote {args.n} {args.task} prompts to {path}")
        return 0
    if args.task == "calc":
        from relax.agentic.tasks.calculator import generate_calc

        path = generate_calc(args.out, n=args.n, seed=args.seed, messages=args.messages)
        print(f"wrote {args.n} calculator-tool prompts to {path}")
        return 0
    if args.task == "search":
        from relax.agentic.tasks.search import generate_search

        prompts, docs = generate_search(args.out, n=args.n, seed=args.seed, messages=args.messages)
        print(f"wrote {args.n} search prompts to {prompts} and the document index to {docs}")
        return 0
    path = generate_arith(args.out, n=args.n, max_digit=args.max_digit, seed=args.seed)
    print(f"wrote {args.n} arithmetic prompts to {path}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from relax.entrypoints.doctor import run_doctor

    return run_doctor(check_ray=not args.no_ray)


def build_parser() -> argparse.ArgumentParser:
    import relax

    p = argparse.ArgumentParser(prog="relax", description="Relax: asynchronous RL post-training for LLMs.")
    p.add_argument("--version", action="version", version=f"relax {relax.__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train with a config file and dotted overrides")
    t.add_argument("config", help="YAML config file (`relax examples list` shows the examples)")
    t.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-4 rollout.n_samples_per_prompt=8"
    )
    t.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="evaluate a checkpoint or model folder on the config's eval sets")
    e.add_argument("config", help="YAML config file with eval.sets")
    e.add_argument("overrides", nargs="*", help="dotted overrides")
    e.add_argument("--checkpoint", help="run checkpoint folder (checkpoints/step_N) or HF model folder")
    e.set_defaults(fn=cmd_eval)

    c = sub.add_parser("config", help="print the resolved config, or describe every field")
    c.add_argument("config", nargs="?", help="YAML config file")
    c.add_argument("overrides", nargs="*", help="dotted overrides")
    c.add_argument("--describe", action="store_true", help="list every field with its default and meaning")
    c.set_defaults(fn=cmd_config)

    m = sub.add_parser("tiny-model", help="write a randomly initialised tiny HF model folder")
    m.add_argument("--out", required=True, help="output folder")
    m.add_argument(
        "--family",
        default="qwen2",
        help="model family (qwen2, qwen3, qwen2_vl, qwen2_5_vl, qwen3_vl, qwen2_5_omni, qwen3_omni)",
    )
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--hidden-size", type=int, default=64, help="hidden size (MLP width is 4x); default 64")
    m.add_argument("--num-layers", type=int, default=2, help="decoder layers; default 2")
    m.add_argument(
        "--init-std",
        type=float,
        default=None,
        help="std of the random weights (default 0.02); larger gives a sharper random head, which a "
        "LoRA run on a random base needs",
    )
    m.set_defaults(fn=cmd_tiny_model)

    d = sub.add_parser("data", help="generate a toy prompt data set")
    d.add_argument(
        "task",
        choices=["arith", "colors", "tones", "calc", "search"],
        help="toy task (colors: images, tones: audio, calc/search: tool use with rollout.agent)",
    )
    d.add_argument("--out", required=True, help="output .jsonl or .parquet file")
    d.add_argument("--n", type=int, default=1000, help="rows")
    d.add_argument("--max-digit", type=int, default=4, help="largest operand")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--inline", action="store_true", help="colors/tones: embed media as base64 in the rows")
    d.add_argument(
        "--messages", action="store_true", help="calc/search: chat prompts that show the JSON tool call"
    )
    d.set_defaults(fn=cmd_data)

    doc = sub.add_parser("doctor", help="what is installed, which engines/backends work, what Ray sees")
    doc.add_argument("--no-ray", action="store_true", help="skip starting a local Ray to inspect it")
    doc.set_defaults(fn=cmd_doctor)

    from relax.entrypoints.engine_cmd import add_engine_parser

    add_engine_parser(sub)
    from relax.entrypoints.agent_cmd import add_agent_parser

    add_agent_parser(sub)
    from relax.entrypoints.export_cmd import add_export_parser

    add_export_parser(sub)
    from relax.entrypoints.status_cmd import add_status_parser

    add_status_parser(sub)
    from relax.entrypoints.examples_cmd import add_examples_parser

    add_examples_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    parser = build_parser()
    args = parser.parse_args(argv)
    fn = getattr(args, "fn", None) or getattr(args, "func", None)
    if fn is None:
        parser.parse_args([*(argv if argv is not None else sys.argv[1:]), "--help"])
    try:
        rc = int(fn(args) or 0)
        sys.stdout.flush()  # a pipe buffers the output: its write happens here, inside the guard
        return rc
    except BrokenPipeError:
        # The reader went away (`relax config --describe | head`): that is the reader's choice, not an
        # error. Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
