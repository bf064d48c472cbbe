"""The running batch's KV cache: left-padded per-layer key/value tensors plus a 0/1 attention mask.

Layout, per layer: keys and values [B, H_kv, L, D]; `mask_BL` [B, L] is 1 on real tokens, 0 on left
padding. Every row ends at the same column, so one decode step appends one column for the whole batch.
Rows join (`concat`: left-pad the shorter cache with zeros) and leave (`select`: gather rows, then drop
the left columns that every remaining row pads) between steps. RoPE is applied before caching with each
row's own positions, so shifting a row's columns does not change its attention.

Zeros, not garbage, fill the padding: a masked key gets attention weight exactly 0, and 0 * finite = 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

logger = logging.getLogger(__name__)


@dataclass
class PaddedKVCache:
    keys: list[Tensor]  # per layer [B, H_kv, L, D]
    values: list[Tensor]  # per layer [B, H_kv, L, D]
    mask_BL: Tensor  # [B, L] long, 1 = real token, 0 = left padding

    @property
    def batch_size(self) -> int:
        return self.mask_BL.shape[0]

    @property
    def length(self) -> int:
        return self.mask_BL.shape[1]

    def num_tokens(self) -> int:
        """Real (unpadded) tokens held, over all rows."""
        return int(self.mask_BL.sum().item())

    def to_hf(self) -> DynamicCache:
        """A `DynamicCache` over these tensors (no copy); the model appends one column per step."""
        return DynamicCache(ddp_cache_data=list(zip(self.keys, self.values, strict=True)))

    @classmethod
    def from_hf(cls, cache: DynamicCache, mask_BL: Tensor) -> PaddedKVCache:
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        if keys[0].shape[-2] != mask_BL.shape[1]:
            raise RuntimeError(
                f"KV cache holds {keys[0].shape[-2]} columns but the mask {mask_BL.shape[1]}; "
                "models with sliding-window or non-attention layers are not supported by this engine"
            )
        return cls(keys, values, mask_BL)

    def select(self, rows: list[int]) -> PaddedKVCache | None:
        """The cache of `rows` (repeats allowed: a prompt's prefill shared by n samples), with the left
        columns that all of them pad removed; None when `rows` is empty."""
        if not rows:
            return None
        idx = torch.tensor(rows, device=self.mask_BL.device)
        mask = self.mask_BL.index_select(0, idx)
        start = int((mask.sum(dim=0) == 0).long().cumprod(dim=0).sum().item())  # all-pad leading columns
        return PaddedKVCache(
            [k.index_select(0, idx)[:, :, start:] for k in self.keys],
            [v.index_select(0, idx)[:, :, start:] for v in self.values],
            mask[:, start:],
        )

    @staticmethod
    def concat(caches: list[PaddedKVCache | None]) -> PaddedKVCache | None:
        """Stack caches along the batch, left-padding each to the longest with zeros."""
        caches = [c for c in caches if c is not None and c.batch_size > 0]
        if not caches:
            return None
        if len(caches) == 1:
            return caches[0]
        L = max(c.length for c in caches)

        def pad(t: Tensor, n: int) -> Tensor:  # left-pad the sequence axis (-2 for KV, -1 for masks)
            if n == 0:
                return t
            dim = -2 if t.dim() == 4 else -1
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        n_layers = len(caches[0].keys)
        keys = [torch.cat([pad(c.keys[i], L - c.length) for c in caches]) for i in range(n_layers)]
        values = [torch.cat([pad(c.values[i], L - c.length) for c in caches]) for i in range(n_layers)]
        mask = torch.cat([pad(c.mask_BL, L - c.length) for c in caches])
        return PaddedKVCache(keys, values, mask)
