"""`relax export CHECKPOINT_DIR --config CONFIG --out DIR`: a trainer checkpoint as a Hugging Face folder.

Reads the sharded DCP checkpoint of either training backend (any rank count wrote it; one process reads
it here), rebuilds the model the config describes (with its LoRA adapters, if any) and writes a folder
that `AutoModelForCausalLM.from_pretrained` loads, with the base model's tokenizer. LoRA runs export the
merged model by default (`--merge-lora`), or a PEFT adapter folder (`--adapter-only`) that
`PeftModel.from_pretrained(base, DIR)` loads.
"""

from __future__ import annotations

import argparse
import sys

from relax.backends.training.export import export_checkpoint


def cmd_export(args: argparse.Namespace) -> int:
    from relax.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"relax export: {e}", file=sys.stderr)
        return 2
    try:
        out = export_checkpoint(
            args.checkpoint, cfg, args.out, adapter_only=args.adapter_only, progress=not args.no_progress
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"relax export: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {out}")
    return 0


def add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="write a trainer checkpoint as a Hugging Face model folder")
    p.add_argument("checkpoint", help="checkpoint folder (e.g. runs/NAME/checkpoints/step_000050)")
    p.add_argument("--config", required=True, help="the run's config (runs/NAME/config.yaml)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the config")
    p.add_argument("--no-progress", action="store_true", help="no progress bar over the export's stages")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--merge-lora", action="store_true", help="LoRA: merge adapters into the weights (default)"
    )
    mode.add_argument("--adapter-only", action="store_true", help="LoRA: write only the PEFT adapter folder")
    p.set_defaults(fn=cmd_export)
