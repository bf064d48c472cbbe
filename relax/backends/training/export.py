"""A trainer checkpoint as a Hugging Face model folder (`relax export`, `relax eval --checkpoint`).

Reads the sharded DCP checkpoint of either training backend (any rank count wrote it; one process reads
it here), rebuilds the model the config describes (with its LoRA adapters, if any) and writes a folder
that `AutoModelForCausalLM.from_pretrained` loads, with the base model's tokenizer. `progress=True`
shows a bar over its stages (base model, checkpoint read, write, tokenizer): `relax export` does.
"""

from __future__ import annotations

import logging
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


def export_checkpoint(
    checkpoint: str | Path, cfg, out: str | Path, *, adapter_only: bool = False, progress: bool = False
) -> Path:
    """Load `checkpoint` into the model `cfg` (a `RelaxConfig`) describes and save it to `out`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from relax.backends.training.lora import export_lora, wrap_lora
    from relax.backends.training.torch_backend import DTYPES

    lora_cfg = cfg.trainer.lora
    if adapter_only and lora_cfg is None:
        raise ValueError("--adapter-only needs a LoRA run (trainer.lora in the config)")
    dcp_dir = find_dcp_dir(Path(checkpoint))  # a wrong path fails before the model is loaded
    bar = tqdm(total=4, desc="export", unit="stage", disable=not progress)
    bar.set_postfix_str("base model")
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    if lora_cfg is not None:
        model = wrap_lora(model, lora_cfg)
    options = StateDictOptions(ignore_frozen_params=lora_cfg is not None, strict=lora_cfg is None)
    state = {"model": get_model_state_dict(model, options=options)}
    _stage(bar, "checkpoint")
    dcp.load(state, checkpoint_id=str(dcp_dir))
    set_model_state_dict(model, state["model"], options=options)
    model.to(DTYPES[cfg.model.dtype])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _stage(bar, "write")
    if lora_cfg is not None:
        export_lora(model, out, merge=not adapter_only)
    else:
        model.save_pretrained(out)
    _stage(bar, "tokenizer")
    _copy_tokenizer(cfg.model.path, out)
    _stage(bar, "done")
    bar.close()
    logger.info("exported %s to %s", checkpoint, out)
    return out


def _stage(bar, name: str) -> None:
    """The previous stage is done; `name` starts."""
    bar.set_postfix_str(name, refresh=False)
    bar.update(1)


def _copy_tokenizer(model_path: str, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    except (OSError, ValueError) as e:  # a bare checkpoint without tokenizer files
        logger.warning("no tokenizer copied from %s: %s", model_path, e)
