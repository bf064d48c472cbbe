"""The wire form of a sample's `multimodal_inputs` in a `/generate` request: the tensors written with
safetensors, the bytes base64-encoded (one string per prompt).

Relax's engines receive the exact tensors the trainer later sees (no second run of the processor, so
rollout and training log-probs agree). SGLang servers take raw media instead (`image_data`,
`audio_data`); a rollout against SGLang sends those and lets the server run its processor.
"""

from __future__ import annotations

import base64
import logging

from safetensors.torch import load, save
from torch import Tensor

logger = logging.getLogger(__name__)


def encode_inputs(inputs: dict[str, Tensor]) -> str:
    """Tensors -> base64 text of their safetensors serialisation."""
    return base64.b64encode(save({k: v.contiguous() for k, v in inputs.items()})).decode("ascii")


def decode_inputs(text: str) -> dict[str, Tensor]:
    """The inverse of `encode_inputs`; raises ValueError on malformed data."""
    try:
        return dict(load(base64.b64decode(text, validate=True)))
    except Exception as e:  # noqa: BLE001 - binascii/safetensors errors
        raise ValueError(f"multimodal_inputs is not base64-encoded safetensors data ({e})") from e
