"""Window attention of the Qwen2-VL / Qwen2.5-VL vision towers in a few batched calls instead of one per
window.

The towers attend within windows (Qwen2.5-VL: 112 x 112-pixel windows in most blocks, each image whole in
the rest), packed one after the other and delimited by `cu_seqlens`. Without the flash-attention package,
`transformers` runs that as one SDPA call per window: a 448 x 448 image is 16 windows, so eight images
make 128 calls in each of 28 window blocks. On a GPU each call is a tiny kernel behind far more Python
than GPU work, which made most of a VL prefill's time (measured in docs/multimodal.md). Here consecutive windows of the same length
(all the full windows of an image grid; the edge ones differ) are one [windows, heads, length, head size]
SDPA call: the same softmax(q k^T * scale) v per window, a handful of calls per block.

`group_window_attention(model)` replaces the forward of each such attention module of the model (the
engine's and the trainer's, both through `load_causal_lm`); modules of other classes are left as they are.
"""

from __future__ import annotations

import itertools
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# the vision attention classes whose forward this reproduces: qkv -> rotary -> attention per
# cu_seqlens chunk -> proj (transformers 5's qwen2_vl and qwen2_5_vl)
CLASSES = {
    ("transformers.models.qwen2_vl.modeling_qwen2_vl", "VisionAttention"),
    ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLVisionAttention"),
}


def group_window_attention(model: nn.Module) -> int:
    """Batch the window attention of `model`'s vision tower (module docstring); returns how many
    attention modules now run batched (0 for a model without such a tower)."""
    patched = 0
    for module in model.modules():
        cls = type(module)
        if (cls.__module__, cls.__name__) not in CLASSES:
            continue
        rotary = getattr(sys.modules[cls.__module__], "apply_rotary_pos_emb_vision", None)
        if rotary is None or not all(hasattr(module, a) for a in ("qkv", "proj", "num_heads", "scaling")):
            continue  # another layout than the one reproduced here: keep transformers' forward
        module._relax_rotary = rotary
        module.forward = types.MethodType(_forward, module)
        patched += 1
    return patched


def _forward(
    self: Any, hidden_states: Tensor, cu_seqlens: Tensor, position_embeddings: tuple[Tensor, Tensor], **_: Any
) -> Tensor:
    S = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(S, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    q, k = self._relax_rotary(q, k, *position_embeddings)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, S, D]
    return self.proj(windowed_attention(q, k, v, cu_seqlens, self.scaling).transpose(0, 1).reshape(S, -1))


def windowed_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale) v within each chunk [cu_seqlens[i], cu_seqlens[i + 1]) of q, k, v [H, S, D];
    each run of consecutive chunks of one length is a single SDPA call. Returns [H, S, D]."""
    H, _, D = q.shape
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    out, start = [], 0
    for length, run in itertools.groupby(lengths):
        if length == 0:
            continue
        n = len(list(run))
        end = start + n * length

        def windows(t: Tensor, a: int = start, b: int = end, n: int = n, L: int = length) -> Tensor:
            return t[:, a:b].reshape(H, n, L, D).transpose(0, 1)  # [n, H, L, D]

        o = F.scaled_dot_product_attention(windows(q), windows(k), windows(v), scale=scale)
        out.append(o.transpose(0, 1).reshape(H, n * length, D))
        start = end
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)
