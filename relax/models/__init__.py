"""Model kits: tiny Qwen checkpoints and the in-process tokenizer used by tests and toy runs.

Layer: models (ARCHITECTURE.md), the bottom. Imports nothing else of Relax.
"""

from relax.models.tiny import (
    TINY_FAMILIES,
    TinyDims,
    TinyFamily,
    count_parameters,
    get_family,
    write_tiny_model,
)
from relax.models.tokenizer import QWEN25_CHAT_TEMPLATE, train_tiny_tokenizer

__all__ = [
    "QWEN25_CHAT_TEMPLATE",
    "TINY_FAMILIES",
    "TinyDims",
    "TinyFamily",
    "count_parameters",
    "get_family",
    "train_tiny_tokenizer",
    "write_tiny_model",
]
