"""What the scheduler (`scheduler.py`) does with the paged KV cache's blocks: admission's share of them,
placing a prompt in its table row (a prefix-cache hit's blocks, fresh ones for the rest), the in-batch
sharing of uncached prefixes, and preemption when a decode step finds no block free.

Preemption policy: when the pool (`max_total_tokens`) has no block for some row's next token, the step in
flight is read back first (rows that finish give theirs back); then the most recently admitted row is
preempted (last in, first out, as vLLM does: the oldest requests keep their progress), its full blocks
cached and all freed, its sequence put at the front of the queue. It is prefilled again, prompt + output
so far (mostly prefix-cache hits on its own blocks, unless they were evicted meanwhile), when admission
finds blocks for it, and continues with its next token: the output is the one it would have given
without preemption (greedy and seeded sampling alike). Recompute rather than a swap to host memory: a
prefill of a few thousand tokens costs milliseconds on a GPU, and nothing is held aside. A lone row is
never preempted; the pool grows past the budget for it instead (a lone request is always served).

A mixin of `Scheduler`: only the engine thread calls it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from relax.backends.inference.embedded.scheduling.sequence import Sequence

logger = logging.getLogger(__name__)


class BlockRows:
    @property
    def reserved(self) -> int:
        """Tokens of KV blocks held (by rows and the prefix cache)."""
        return self.cache.used_blocks() * self.block

    def _blocks_needed(self, unit: list[Sequence]) -> int:
        """Blocks a unit takes when admitted: its prompt's and its first token's, and for each further
        sample a copied partial block and one to grow into (an estimate; a prefix hit takes fewer)."""
        length = len(unit[0].prefill_ids()) + 1
        return -(-length // self.block) + 2 * (len(unit) - 1)

    # -- one step -------------------------------------------------------------------------------
    def _place(self, prompt: list[int], row: int, force: bool, memo: object = None) -> int | None:
        """Give table row `row` the blocks of `prompt`: a prefix-cache hit's (shared), fresh ones for the
        rest. Returns the tokens the hit covers, or None (nothing taken) when the pool is out of blocks.
        `memo`: the sequence, whose lookup admission made already (`PrefixCache.peek`)."""
        hit = self.prefix.match(prompt, len(prompt) - 1, memo=memo) if self.prefix is not None else []
        self.cache.assign(row, hit)
        if not self.cache.extend(row, len(prompt), force=force):
            self.cache.free_row(row)
            return None
        return len(hit) * self.block

    def _defer_shared(self, units: list[list[Sequence]]) -> list[list[Sequence]]:
        """In-batch sharing (SGLang's in-batch prefix check): a prompt whose leading blocks an earlier
        prompt of this admission computes, and the cache does not hold, goes back to the front of the
        queue; one step later it finds them in the cache. The GRPO samples of a group sent as separate
        requests arrive together, and would otherwise each prefill the whole prompt. The first unit is
        always admitted, so the queue moves.

        Only the blocks past each prompt's cached prefix are compared, keyed from its last cached
        block: two prompts alike past the cache went through the same cached blocks (the cache finds a
        prefix by its tokens), so the blocks of an agent's history the cache holds (hundreds a turn) are
        never hashed again."""
        seen: set[int] = set()
        keep: list[list[Sequence]] = []
        later: list[list[Sequence]] = []
        B = self.block
        for u in units:
            p = u[0].prefill_ids()
            n = (len(p) - 1) // B  # the blocks a hit may cover
            cached, h = self.prefix.peek_end(p, len(p) - 1, memo=u[0])
            chain = []
            for i in range(cached, n):  # a hash per prefix: a scheduling hint, a collision costs nothing
                h = hash((h, tuple(p[i * B : (i + 1) * B])))
                chain.append(h)
            shared = 0
            while shared < len(chain) and chain[shared] in seen:
                shared += 1
            if keep and shared >= 2:  # 2+ blocks to gain by waiting
                later.append(u)
            else:
                keep.append(u)
                seen.update(chain)
        self.waiting.extendleft(reversed(later))
        return keep

    def _cache_row(self, s: Sequence, row: int) -> None:
        """Cache the full blocks of prompt + output of a sequence leaving table row `row`."""
        if self.prefix is None or id(s) in self._stale:
            self._stale.discard(id(s))
        elif s.output_ids:  # KV held: prompt + output[:-1]
            self.prefix.insert(s.group.prompt + s.output_ids[:-1], self.cache.rows[row])

    # -- KV blocks and preemption ---------------------------------------------------------------
    def _ensure_blocks(self) -> int:
        """Give every running row the block its next decode step writes to. When the pool is out of
        blocks, the step in flight is read back first (rows that finish give theirs back), then the most
        recently admitted rows are preempted until the rest fit; a lone row always grows. Returns the
        tokens the read-back generated."""
        generated = 0
        while self.running:
            if self.batch is None:
                self.batch = self._new_batch()
            B = len(self.running)
            need = self.batch.cols + 1  # tokens each row holds after the step
            short = np.flatnonzero(need > self.cache.caps[:B])
            if not short.size or self.cache.extend_rows(short.tolist(), need[short].tolist(), B == 1):
                return generated
            if self.inflight is not None:
                generated += self.drain()
            else:
                self._preempt(max(range(B), key=lambda b: self._order.get(id(self.running[b]), 0)))
        return generated

    def _preempt(self, b: int) -> None:
        """Free row b's blocks (its full ones cached first) and put its sequence back at the front of the
        queue; it is prefilled again (prompt + output so far) when admitted, and continues as before."""
        rows = self.running
        s = rows[b]
        self._cache_row(s, b)
        self._stale.discard(id(s))  # its KV is computed again when it is admitted
        self.cache.free_row(b)
        last = len(rows) - 1
        if b != last:
            self.cache.move([last], [b])
            rows[b] = rows[last]
        rows.pop()
        self._order.pop(id(s), None)
        self.waiting.appendleft([s])
        self.batch = None
        self.preempted += 1
        logger.debug("preempted a sequence of %d tokens (KV blocks exhausted)", s.num_tokens)
