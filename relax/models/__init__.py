"""Model kits: tiny Qwen checkpoints and the in-process tokenizer used by tests and toy runs.

Layer: models (ARCHITECTURE.md), the bottom. Imports nothing else of Relax.

The names below load on first use (PEP 562): `relax.models.tiny` imports every multimodal model class
of `transformers`, about two CPU-seconds, and every role process that only needs
`relax.models.multimodal_model` (the trainer, the engine) would otherwise pay it at start.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "TINY_FAMILIES": "relax.models.tiny",
    "TinyDims": "relax.models.tiny",
    "TinyFamily": "relax.models.tiny",
    "count_parameters": "relax.models.tiny",
    "get_family": "relax.models.tiny",
    "write_tiny_model": "relax.models.tiny",
    "QWEN25_CHAT_TEMPLATE": "relax.models.tokenizer",
    "train_tiny_tokenizer": "relax.models.tokenizer",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'relax.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
