"""The running batch's KV cache: preallocated slots, one per running sequence, written in place.

Layout, per layer: keys and values [S, H_kv, C, D] (S slots, capacity C tokens), views of one store
[2, layers, S, H_kv, C, D]. Row b of the running batch lives in slot b, and token t of a sequence (prompt
and output alike) at column t, so

* a decode step writes one column per row in place (`index_put_` at each row's position) and attends
  over the view `[:B, :, :L]` (no copy, no concatenation);
* a prefill writes each prompt straight into its slot;
* sequences that leave the batch are replaced by running rows from its end (`move`: the rows of every
  layer copied in one gather and one scatter over the store, the batch stays dense in slots 0..B-1; per
  buffer it had been 2 x 2 x layers indexing ops, ~5 ms of host time when half of a 256-row batch left);
* n samples of one prompt share its prefill by copying the slot (`copy`);
* a prompt that continues a cached prefix (`prefix_cache.py`, copied into its slot) writes its other
  tokens at their own columns and attends over the slot (`for_prefill` with columns).

The buffers grow (doubling, with one copy) when the batch needs more slots or columns than allocated,
so memory follows the largest batch actually run, up to `max_running` x the longest reservation.

The model sees this object as its cache: `update(k, v, layer)` is the only method it calls. Which rows
and columns an `update` writes is set by `for_prefill` / `for_decode` before each forward.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class SlotKVCache:
    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.store: Tensor | None = None  # [2, layers, S, H_kv, C, D]: keys, then values
        self.keys: list[Tensor] = []  # per layer [S, H_kv, C, D], views of the store
        self.values: list[Tensor] = []
        self.slots = 0  # S
        self.capacity = 0  # C
        self.generation = 0  # bumped on every reallocation (captured graphs hold the old buffers)
        self._rows: Tensor | None = None  # slots written by the next forward, [B]
        self._arange: Tensor | None = None  # 0..S-1, the rows of a decode step
        self._pos_B: Tensor | None = None  # decode: column written per row, [B]
        self._length = 0  # decode: columns attended, L; a prefill past a cached prefix: keys returned
        self._cols: Tensor | None = None  # a prefill past a cached prefix: column of each token, [N, T]
        self._prefill = False

    # -- allocation ----------------------------------------------------------------------------
    def reserve(self, slots: int, length: int, max_slots: int) -> None:
        """Make room for `slots` rows of `length` columns (grown by doubling, keeping the contents)."""
        if slots <= self.slots and length <= self.capacity:
            return
        new_s = self.slots if slots <= self.slots else min(max(slots, 2 * self.slots), max(max_slots, slots))
        new_c = self.capacity
        if length > self.capacity:
            new_c = _round_up(max(length, self.capacity * 3 // 2), 64)
        shape = (2, self.num_layers, new_s, self.num_kv_heads, new_c, self.head_dim)
        store = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.store is not None:
            store[:, :, : self.slots, :, : self.capacity].copy_(self.store)
        self.store = store
        self.keys, self.values = list(store[0].unbind(0)), list(store[1].unbind(0))
        self.slots, self.capacity = new_s, new_c
        self.generation += 1
        mib = store.numel() * store.element_size() / 2**20
        logger.debug("KV cache grown to %d slots x %d tokens (%.0f MiB)", new_s, new_c, mib)

    def release(self) -> None:
        """Free the buffers (after a retract); the next `reserve` allocates again."""
        self.store, self.keys, self.values, self.slots, self.capacity = None, [], [], 0, 0
        self.generation += 1

    # -- row moves -----------------------------------------------------------------------------
    def copy(self, src: int, dsts: list[int], length: int) -> None:
        """Copy the first `length` columns of slot `src` into each slot of `dsts`."""
        if not dsts:
            return
        idx = torch.tensor(dsts, device=self.device)
        store = self.store
        store[:, :, idx, :, :length] = store[:, :, src : src + 1, :, :length]

    def move(self, srcs: list[int], dsts: list[int], length: int) -> None:
        """Copy the first `length` columns of slot srcs[i] into slot dsts[i], all rows at once (one
        gather and one scatter over the store; the two lists must not share a slot)."""
        if not srcs:
            return
        src = torch.tensor(srcs, device=self.device)
        dst = torch.tensor(dsts, device=self.device)
        store = self.store
        store[:, :, dst, :, :length] = store[:, :, src, :, :length]

    # -- what the next forward writes ----------------------------------------------------------
    def for_prefill(self, rows: Tensor, cols_NT: Tensor | None = None, length: int = 0) -> SlotKVCache:
        """The next forward is a prefill of len(rows) right-padded prompts into slots `rows`. With
        `cols_NT`, the prompts continue prefixes already in their slots (`prefix_cache.py`): token t of
        prompt n goes to column cols_NT[n, t], and attention sees the first `length` columns of the slot."""
        self._prefill, self._rows, self._cols, self._length = True, rows, cols_NT, length
        return self

    def for_decode(self, pos_B: Tensor, length: int, rows_B: Tensor | None = None) -> SlotKVCache:
        """The next forward decodes rows 0..B-1, writing column pos_B[b] and attending over `length`.
        `rows_B` (= arange(B)) may be passed by a caller that needs the tensor to stay (a CUDA graph)."""
        B = pos_B.shape[0]
        self._prefill, self._pos_B, self._length = False, pos_B, length
        if rows_B is None:
            if self._arange is None or self._arange.shape[0] < B or self._arange.device != pos_B.device:
                self._arange = torch.arange(max(B, self.slots), device=pos_B.device)
            rows_B = self._arange[:B]
        self._rows = rows_B
        return self

    def prefill_buffers(self, layer_idx: int) -> tuple[Tensor, Tensor, Tensor]:
        """For a prefill that writes the cache itself (`prefill_rope`): the layer's key and value buffers
        and the slot of each prompt."""
        return self.keys[layer_idx], self.values[layer_idx], self._rows

    def decode_buffers(self, layer_idx: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """For a decode step that writes the cache itself (`rope_store`): the layer's key and value
        buffers, the slot and column each row writes, and the columns attended."""
        return self.keys[layer_idx], self.values[layer_idx], self._rows, self._pos_B, self._length

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Called by every attention layer: store the new keys/values, return what to attend over."""
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        if self._prefill and self._cols is not None:  # after a cached prefix: attend over the slot
            rows, L = self._rows, self._length
            k_buf[rows[:, None], :, self._cols] = key_states.transpose(1, 2)  # [N, T, H_kv, D]
            v_buf[rows[:, None], :, self._cols] = value_states.transpose(1, 2)
            return k_buf[rows, :, :L], v_buf[rows, :, :L]
        if self._prefill:
            T = key_states.shape[2]
            k_buf[self._rows, :, :T] = key_states
            v_buf[self._rows, :, :T] = value_states
            return key_states, value_states  # the prompt attends to itself only
        B = key_states.shape[0]
        k_buf[self._rows, :, self._pos_B] = key_states[:, :, 0]
        v_buf[self._rows, :, self._pos_B] = value_states[:, :, 0]
        return k_buf[:B, :, : self._length], v_buf[:B, :, : self._length]
