"""The `model` section: the policy's weights (a folder or a Hub id), their dtype and the reference model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relax.data.config import Section


class ModelConfig(Section):
    path: str = Field(
        ...,
        description="Hugging Face model folder (config.json, safetensors, tokenizer), or a Hub id "
        "(`Qwen/Qwen2.5-0.5B-Instruct`) resolved through the Hub cache (HF_HOME; HF_HUB_OFFLINE=1: the cache "
        "only) to the folder of one commit before any role starts.",
    )
    revision: str | None = Field(
        None,
        description="Hub branch, tag or commit when `path` (and `reference_path`) is a Hub id; None = the "
        "default branch. config.yaml records the commit it resolved to, so every node and a resume load "
        "the same files.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Parameter dtype of the trainer's master weights and of the engines."
    )
    reference_path: str | None = Field(
        None,
        description="Model folder of the frozen reference (KL terms) and distillation teacher; None = "
        "`path`, the initial policy. On-policy distillation needs it.",
    )
