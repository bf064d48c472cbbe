"""A prefix cache across requests over the paged KV cache (`paged_kv_cache.py`): full blocks of token
prefixes seen before stay in the pool after their sequence leaves, so a request that starts with a cached
prefix (the n samples of a GRPO group sent as separate requests, the next turn of an agent session, a
shared system prompt) prefills only the tokens past it.

Nothing is copied: the cache holds a reference to each block it keeps, and a hit puts the blocks into the
new row's block table (`PagedKVCache.assign`, a reference each). A block is freed when no row and not the
cache holds it. A cached block is always full and never written again: a hit stops at a block boundary
and the sequence writes its own tokens past it into blocks of its own.

Index: a block is found by (id of its parent block, its BLOCK token ids), so a lookup walks the prompt
block by block from the root (a radix tree whose edges are whole blocks; a key is exact, no hash that
could collide). Eviction is LRU over leaves that no running row holds: a lookup or insert touches its
chain from the leaf up to the root (each block takes the next `stamp`), so a parent is always more recent
than its children. `children` is each entry's count of cached children (an entry with children is not
evicted). The leaves wait in a heap by stamp, pushed when they become leaves or are touched (stale
entries are skipped when popped), and a parent whose last child goes joins it: evicting a sequence's
chain of n blocks costs n heap operations. (A scan of every cached block for the oldest leaf found one
leaf per chain a scan: at 16k cached blocks, freeing a 7k-token history took a second of an engine step.)
The pool evicts when it needs blocks (`PagedKVCache.reclaim`), so the cache never keeps a request out or
makes one wait.

Only the last full block boundary before the prompt's last token can hit: that token's logits are needed
to sample, so it is always computed. Every weight load empties the cache (`clear`, via
`Scheduler.flush_prefix`): KV computed under old weights is never reused; sequences running across the
update are not inserted when they finish (their KV mixes two weight versions).

Only the engine thread calls this class.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass

from relax.backends.inference.embedded.model.paged_kv_cache import BLOCK, PagedKVCache

logger = logging.getLogger(__name__)

__all__ = ["BLOCK", "PrefixCache"]

MAX_PEEKS = 4096  # kept lookups (one per waiting sequence asked about) before the memo is emptied


@dataclass(slots=True, eq=False)  # eq=False: identity comparison, fast init
class _Block:
    id: int  # unique for the cache's lifetime (a parent's id is part of its children's keys)
    key: tuple[int, tuple[int, ...]]  # (parent id, the block's token ids); parent id 0 is the root
    index: int  # the block in the pool
    parent: _Block | None
    children: int = 0  # cached child blocks (a block with children is not evicted)
    stamp: int = 0  # when it was last touched (larger: more recent)
    cached: bool = True  # False once dropped (its heap entries are stale)


class PrefixCache:
    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self.block = kv.block
        self.blocks: dict[tuple[int, tuple[int, ...]], _Block] = {}
        self._at: dict[int, _Block] = {}  # pool block -> its cache entry (a cached block is one prefix's)
        # `_lookup` memo: (tokens' length, limit, chain, `_grown` when walked) per waiting sequence
        self._peeks: dict[object, tuple[int, int, list[_Block], int]] = {}
        self._grown = 0  # inserts that added blocks (a kept chain may go on further since)
        self._leaves: list[tuple[int, int, _Block]] = []  # heap of (stamp, id, block); see the docstring
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.hit_tokens = 0  # prompt tokens served from the cache
        self.lookup_tokens = 0  # prompt tokens looked up (the denominator of the hit rate)
        self.evicted = 0  # blocks evicted to make room
        kv.reclaim = self.evict

    @property
    def tokens(self) -> int:
        """Tokens held."""
        return len(self.blocks) * self.block

    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    def clear(self) -> None:
        """Forget every block (a weight update, `/flush_cache`): the cache's references are dropped; rows
        that hold a block keep it."""
        for b in self.blocks.values():
            self.kv.unhold(b.index)
        self.release()

    def release(self) -> None:
        """Forget every block when the pool itself is freed (a pause that drops the KV cache)."""
        for b in self.blocks.values():
            b.cached = False
        self.blocks.clear()
        self._at.clear()
        self._peeks.clear()
        self._leaves.clear()

    # -- lookup ----------------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int, memo: object = None) -> list[int]:
        """The pool blocks of the longest block-aligned cached prefix of `tokens` no longer than `limit`,
        touched as used; counts toward the hit rate. `memo`: as for `peek`, whose walk it reuses."""
        chain = self._lookup(tokens, limit, memo)
        self._peeks.pop(memo, None)  # placed: its last lookup
        self._touch(chain)
        self.lookup_tokens += len(tokens)
        self.hit_tokens += len(chain) * self.block
        return [b.index for b in chain]

    def peek(self, tokens: list[int], limit: int, memo: object = None) -> int:
        """How many blocks of `tokens` (no more than `limit` tokens) `match` would find; touches nothing.
        With `memo` (the waiting sequence asked about) the chain found is kept and brought up to date
        (`_lookup`) until `match` places the sequence: admission asks about the same queue entries
        several times a step and every step they wait (planning, the in-batch sharing check, placing
        them), and each walk of an agent's 6k-token history is 400 dictionary lookups."""
        return len(self._lookup(tokens, limit, memo))

    def peek_end(self, tokens: list[int], limit: int, memo: object = None) -> tuple[int, int]:
        """`peek`, and the id of the last block found (0, the root's, for none): two prompts that go
        on alike past the same cached block share that prefix."""
        chain = self._lookup(tokens, limit, memo)
        return len(chain), chain[-1].id if chain else 0

    def _lookup(self, tokens: list[int], limit: int, memo: object) -> list[_Block]:
        """The cached chain `match` finds, kept per `memo` (never mutated: callers only read it).

        A kept chain stays right while its blocks stay cached, and only a leaf is ever dropped, so the
        chain holds iff its last block is cached (else its cached head is the part to keep). An insert
        since may have cached blocks past its end: the walk goes on from there, one lookup when nothing
        came, instead of the prompt's whole history again (inserts come every step that prefills)."""
        kept = self._peeks.get(memo) if memo is not None else None
        if kept is not None and kept[0] == len(tokens) and kept[1] == limit:
            chain, grown = kept[2], kept[3]
            if chain and not chain[-1].cached:
                chain, grown = list(itertools.takewhile(lambda b: b.cached, chain)), -1
            if grown == self._grown:
                return chain
            chain = self._walk(tokens, limit // self.block, list(chain))
        else:
            chain = self._walk(tokens, limit // self.block)
        if memo is not None:
            if len(self._peeks) >= MAX_PEEKS:  # sequences that left the queue unplaced (aborted)
                self._peeks.clear()
            self._peeks[memo] = (len(tokens), limit, chain, self._grown)
        return chain

    def _walk(self, tokens: list[int], max_blocks: int, chain: list[_Block] | None = None) -> list[_Block]:
        """The cached chain of `tokens`' first `max_blocks` blocks, looked up by token ids; `chain`: its
        first blocks, already known."""
        chain = chain if chain is not None else []
        parent = chain[-1].id if chain else 0
        B = self.block
        for i in range(len(chain), max_blocks):
            block = self.blocks.get((parent, tuple(tokens[i * B : (i + 1) * B])))
            if block is None:
                break
            chain.append(block)
            parent = block.id
        return chain

    def _touch(self, chain: list[_Block]) -> None:
        for block in reversed(chain):  # leaf first, so each parent ends more recent than its children
            block.stamp = next(self._clock)
            if block.children == 0:
                self._push(block)
        if len(self._leaves) > 2 * len(self.blocks) + 64:  # stale entries: rebuild from the live leaves
            self._leaves = [(b.stamp, b.id, b) for b in self.blocks.values() if b.children == 0]
            heapq.heapify(self._leaves)

    def _push(self, block: _Block) -> None:
        heapq.heappush(self._leaves, (block.stamp, block.id, block))

    def _pop_leaf(self) -> _Block | None:
        """The least recently used leaf, off the heap (stale entries dropped); None when there is none."""
        while self._leaves:
            stamp, _, b = heapq.heappop(self._leaves)
            if b.cached and b.children == 0 and b.stamp == stamp:
                return b
        return None

    # -- insert and evict ------------------------------------------------------------------------
    def insert(self, tokens: list[int], row_blocks: list[int]) -> int:
        """Cache the full blocks of `tokens`, whose KV is in `row_blocks` (a row's blocks in token order);
        returns the blocks added. A block already cached under the same key keeps the cached copy."""
        n = min(len(tokens) // self.block, len(row_blocks))
        # A row's leading blocks are mostly the cache's own (the hit it was admitted with, the prompt
        # cached at its prefill): found by pool block, no token keys built; the token walk goes on past
        # them (blocks another row computed for the same tokens are cached under its blocks).
        chain: list[_Block] = []
        for index in row_blocks[:n]:
            block = self._at.get(index)
            if block is None or block.parent is not (chain[-1] if chain else None):
                break
            chain.append(block)
        chain = self._walk(tokens, n, chain)
        start = len(chain)
        indices = row_blocks[start:n]
        if indices:  # a finished row of 2k tokens brings ~130 new blocks, 256 rows of them in one step
            cached = self.kv.cached[indices]
            if cached.any():  # cached under another key already (cannot be: a block is one prefix)
                indices = indices[: int(cached.argmax())]
        if not indices:
            self._touch(chain)
            return 0
        B = self.block
        parent = chain[-1] if chain else None
        if parent is not None:
            parent.children += 1
        blocks, at, ids = self.blocks, self._at, self._ids
        pid = parent.id if parent is not None else 0
        # the walk stopped at the first key not cached, and every later key starts with a new block's
        # id, so none of these keys can be in the cache yet
        tail = iter(tokens[start * B : (start + len(indices)) * B])
        keys = zip(*[tail] * B, strict=True)  # each block's B token ids, one tuple a block
        new: list[_Block] = []
        for index, key_tokens in zip(indices, keys, strict=True):
            block = _Block(next(ids), (pid, key_tokens), index, parent, 1)
            blocks[block.key] = block
            at[index] = block
            new.append(block)
            parent, pid = block, block.id
        new[-1].children = 0
        self.kv.hold_many(indices)
        self._grown += 1
        self._touch(chain + new)
        return len(new)

    def evict(self, want: int) -> int:
        """Free up to `want` pool blocks: LRU leaves no row holds; returns how many were freed."""
        freed, held = 0, []
        while freed < want:
            b = self._pop_leaf()
            if b is None:
                break
            if self.kv.refs[b.index] != 1:  # a running row holds it too: not freed by dropping it
                held.append(b)
                continue
            self._drop(b)
            freed += 1
        for b in held:
            self._push(b)
        return freed

    def evict_to(self, tokens: int) -> None:
        """Drop LRU leaves (held by rows or not) until at most `tokens` tokens are cached."""
        while self.tokens > max(tokens, 0):
            leaf = self._pop_leaf()
            if leaf is None:
                break
            self._drop(leaf)

    def _drop(self, block: _Block) -> None:
        del self.blocks[block.key]
        del self._at[block.index]
        block.cached = False
        self.kv.unhold(block.index)
        self.evicted += 1
        parent = block.parent
        if parent is not None:
            parent.children -= 1
            if parent.children == 0 and parent.cached:
                self._push(parent)
