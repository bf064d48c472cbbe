"""A prefix cache across requests: the KV of token prefixes seen before, kept in fixed-size blocks, so a
request that starts with a cached prefix (the n samples of a GRPO group sent as separate requests, the
next turn of an agent session, a shared system prompt) prefills only the tokens past it.

Why blocks copied into the slot, not a paged cache: the running batch's KV is one contiguous slot per
sequence (`kv_cache.py`), which the decode kernels (`attention_step.py`, the CUDA graphs) read by slot
and column. Keeping the cache apart, in a pool of blocks of `BLOCK` tokens [2, layers, H_kv, blocks,
BLOCK, D], leaves every decode path as it is: a hit's blocks are copied into the new sequence's slot
(one gather over the pool, a few bytes per token moved instead of a whole forward pass per token), and a
sequence's blocks are copied out of its slot when it is prefilled and when it finishes. No running
sequence ever points into the pool, so every block can be evicted at any moment between two steps: the
cache can never make a request fail or wait for memory. The pool's allocation grows by doubling, never
past the running batch's own KV allocation (`grow_limit`, set by the scheduler), so the cache at most
doubles the engine's KV memory; a memory plan made beside the engine (colocated training) sees no more.

Index: a block is found by (id of its parent block, its BLOCK token ids), so a lookup walks the prompt
block by block from the root (a radix tree whose edges are whole blocks; a key is exact, no hash that
could collide). Eviction is LRU over leaves: a lookup or insert touches its chain from the leaf up to the
root, so a parent is always more recent than its children and the least recent block is a leaf (a block
with children is kept while they are). `children` is each block's reference count.

Only the last full block boundary before the prompt's last token can hit: that token's logits are needed
to sample, so it is always computed. Every weight load empties the cache (`clear`, via
`Scheduler.flush_prefix`): KV computed under old weights is never reused; sequences running across the
update are not inserted when they finish (their KV mixes two weight versions).

Only the engine thread calls this class.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

BLOCK = 16  # tokens per block: small enough that a hit stops close to the prompt's end


def _blocks(store: Tensor) -> Tensor:
    """A `SlotKVCache` store [2, layers, S, H_kv, C, D] as blocks [2, layers, S, H_kv, C / BLOCK, BLOCK, D]
    (a view; its capacity is a multiple of 64)."""
    return store.unflatten(4, (store.shape[4] // BLOCK, BLOCK))


@dataclass(slots=True, eq=False)  # eq=False: identity comparison (`block is not protect`), fast init
class _Block:
    id: int  # unique for the cache's lifetime (a parent's id is part of its children's keys)
    key: tuple[int, tuple[int, ...]]  # (parent id, the block's token ids); parent id 0 is the root
    index: int  # block index in the pool
    parent: _Block | None
    children: int = 0  # cached child blocks (a block with children is not evicted)


class PrefixCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_tokens: int,
    ) -> None:
        """`max_tokens`: the most tokens the pool may ever hold (the engine's `max_total_tokens`); what it
        may hold at a given moment is what the running batch leaves of it (`room` of `insert`)."""
        self.shape = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.max_blocks = max(max_tokens // BLOCK, 0)
        self.grow_limit = self.max_blocks  # the pool's allocation stops growing here (`Scheduler`)
        self.pool: Tensor | None = None  # [2, layers, H_kv, blocks, BLOCK, D], grown by doubling
        self.blocks: OrderedDict[tuple[int, tuple[int, ...]], _Block] = OrderedDict()  # oldest first
        self.free: list[int] = []  # pool indices not in use
        self._ids = itertools.count(1)
        self.hit_tokens = 0  # prompt tokens served from the cache
        self.lookup_tokens = 0  # prompt tokens looked up (the denominator of the hit rate)
        self.evicted = 0  # blocks evicted to make room
        self._pending: dict[int, tuple[int, int]] = {}  # pool index -> (slot, block column) to copy

    @property
    def tokens(self) -> int:
        """Tokens held."""
        return len(self.blocks) * BLOCK

    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def clear(self) -> None:
        """Forget every block (a weight update, `/flush_cache`); the pool's memory stays allocated."""
        self.blocks.clear()
        self._pending.clear()
        self.free = list(range(self.pool.shape[3])) if self.pool is not None else []

    def release(self) -> None:
        """Forget every block and free the pool's memory (a pause that drops the KV cache)."""
        self.clear()
        self.pool, self.free = None, []

    # -- lookup ----------------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int) -> list[_Block]:
        """The cached blocks of the longest block-aligned prefix of `tokens` no longer than `limit`,
        touched as used; counts toward the hit rate."""
        chain = self._walk(tokens, limit // BLOCK)
        self._touch(chain)
        self.lookup_tokens += len(tokens)
        self.hit_tokens += len(chain) * BLOCK
        return chain

    def peek(self, tokens: list[int], limit: int) -> int:
        """How many blocks of `tokens` (no more than `limit` tokens) `match` would find; touches nothing."""
        return len(self._walk(tokens, limit // BLOCK))

    def load(self, hits: list[tuple[list[_Block], int]], store: Tensor) -> None:
        """Copy each (chain, slot)'s blocks into columns 0.. of that slot of a `SlotKVCache` store
        [2, layers, S, H_kv, C, D], all in one gather and one scatter."""
        where = [(b.index, slot, i) for chain, slot in hits for i, b in enumerate(chain)]
        if not where:
            return
        p, s, c = self._indices(where)
        _blocks(store)[:, :, s, :, c] = self.pool[:, :, :, p].movedim(3, 0)

    def write(self, store: Tensor) -> None:
        """Copy the blocks inserted since the last `write` from their slots of `store` into the pool, in
        one gather and one scatter (before anything overwrites those slots)."""
        if not self._pending:
            return
        where = [(i, slot, col) for i, (slot, col) in self._pending.items()]
        self._pending.clear()
        p, s, c = self._indices(where)
        self.pool[:, :, :, p] = _blocks(store)[:, :, s, :, c].movedim(0, 3)

    def _indices(self, where: list[tuple[int, int, int]]) -> tuple[Tensor, Tensor, Tensor]:
        """(pool index, slot, block column) lists as device tensors, sent without waiting for the
        device (a blocking copy would stall the host behind the decode step in flight)."""
        idx = torch.tensor(where, dtype=torch.long).t().contiguous()
        if self.device.type == "cuda":
            idx = idx.pin_memory().to(self.device, non_blocking=True)
        return idx[0], idx[1], idx[2]

    def _walk(self, tokens: list[int], max_blocks: int) -> list[_Block]:
        chain: list[_Block] = []
        parent = 0
        for i in range(max_blocks):
            block = self.blocks.get((parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        return chain

    def _touch(self, chain: list[_Block]) -> None:
        for block in reversed(chain):  # leaf first, so each parent ends more recent than its children
            self.blocks.move_to_end(block.key)

    # -- insert and evict ------------------------------------------------------------------------
    def insert(self, tokens: list[int], slot: int, room: int) -> int:
        """Cache the full blocks of `tokens`, whose KV is in columns 0..len(tokens)-1 of `slot`, holding at
        most `room` tokens in all (evicting LRU leaves for it); returns the blocks added. Their KV is
        copied by the next `write`."""
        n = len(tokens) // BLOCK
        chain = self._walk(tokens, n)
        self._touch(chain)
        new: list[_Block] = []
        parent = chain[-1] if chain else None
        for i in range(len(chain), n):
            while self.tokens + BLOCK > room or not self._has_free():
                if not self._evict_one(protect=parent):
                    break
            if self.tokens + BLOCK > room or not self._has_free():
                break
            key = (parent.id if parent else 0, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
            block = _Block(next(self._ids), key, self.free.pop(), parent)
            if parent is not None:
                parent.children += 1
            self.blocks[key] = block
            new.append(block)
            parent = block
        for i, block in enumerate(new):
            self._pending[block.index] = (slot, len(chain) + i)
        if new:
            self._touch(chain + new)
        return len(new)

    def evict_to(self, tokens: int) -> None:
        """Evict LRU leaves until at most `tokens` tokens are held."""
        while self.tokens > max(tokens, 0) and self._evict_one(protect=None):
            pass

    def _evict_one(self, protect: _Block | None) -> bool:
        for block in self.blocks.values():  # oldest first; by the touch order the first is a leaf
            if block.children == 0 and block is not protect:
                del self.blocks[block.key]
                self.free.append(block.index)
                self._pending.pop(block.index, None)
                self.evicted += 1
                if block.parent is not None:
                    block.parent.children -= 1
                return True
        return False

    def _has_free(self) -> bool:
        """A pool index is free, growing the pool (doubling, up to `max_blocks`) when none is."""
        if self.free:
            return True
        have = 0 if self.pool is None else self.pool.shape[3]
        want = min(max(2 * have, 64), self.max_blocks, max(self.grow_limit, 64))
        if want <= have:
            return False
        L, H, D = self.shape
        pool = torch.empty((2, L, H, want, BLOCK, D), dtype=self.dtype, device=self.device)
        if self.pool is not None:
            pool[:, :, :, :have].copy_(self.pool)
        self.pool = pool
        self.free = list(range(want - 1, have - 1, -1))  # pop() hands out the lowest index first
        logger.debug("prefix cache pool grown to %d blocks of %d tokens", want, BLOCK)
        return True
