"""`relax export CHECKPOINT_DIR --config CONFIG --out DIR`: a trainer checkpoint as a Hugging Face folder.

Reads the sharded DCP checkpoint of either training backend (any rank count wrote it; one process reads
it here), rebuilds the model the config describes (with its LoRA adapters, if any) and writes a folder
that `AutoModelForCausalLM.from_pretrained` loads, with the base model's tokenizer. LoRA runs export the
merged model by default (`--merge-lora`), or a PEFT adapter folder (`--adapter-only`) that
`PeftModel.from_pretrained(base, DIR)` loads.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def find_dcp_dir(checkpoint: Path) -> Path:
    """The `dcp` folder of a trainer checkpoint: accepts the step folder, its `actor/`, or `dcp/` itself."""
    for cand in (checkpoint, checkpoint / "dcp", checkpoint / "actor" / "dcp"):
        if (cand / ".metadata").exists():
            return cand
    raise FileNotFoundError(
        f"no DCP checkpoint under {checkpoint}; pass a run's checkpoint folder (holding actor/dcp/.metadata)"
    )


def export_checkpoint(checkpoint: str | Path, cfg, out: str | Path, *, adapter_only: bool = False) -> Path:
    """Load `checkpoint` into the model `cfg` (a `RelaxConfig`) describes and save it to `out`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from transformers import AutoModelForCausalLM

    from relax.backends.training.lora import export_lora, wrap_lora
    from relax.backends.training.torch_backend import DTYPES

    lora_cfg = cfg.trainer.lora
    if adapter_only and lora_cfg is None:
        raise ValueError("--adapter-only needs a LoRA run (trainer.lora in the config)")
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    if lora_cfg is not None:
        model = wrap_lora(model, lora_cfg)
    options = StateDictOptions(ignore_frozen_params=lora_cfg is not None, strict=lora_cfg is None)
    state = {"model": get_model_state_dict(model, options=options)}
    dcp.load(state, checkpoint_id=str(find_dcp_dir(Path(checkpoint))))
    set_model_state_dict(model, state["model"], options=options)
    model.to(DTYPES[cfg.model.dtype])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if lora_cfg is not None:
        export_lora(model, out, merge=not adapter_only)
    else:
        model.save_pretrained(out)
    _copy_tokenizer(cfg.model.path, out)
    logger.info("exported %s to %s", checkpoint, out)
    return out


def _copy_tokenizer(model_path: str, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    except (OSError, ValueError) as e:  # a bare checkpoint without tokenizer files
        logger.warning("no tokenizer copied from %s: %s", model_path, e)


def cmd_export(args: argparse.Namespace) -> int:
    from relax.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"relax export: {e}", file=sys.stderr)
        return 2
    try:
        out = export_checkpoint(args.checkpoint, cfg, args.out, adapter_only=args.adapter_only)
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
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--merge-lora", action="store_true", help="LoRA: merge adapters into the weights (default)"
    )
    mode.add_argument("--adapter-only", action="store_true", help="LoRA: write only the PEFT adapter folder")
    p.set_defaults(fn=cmd_export)
