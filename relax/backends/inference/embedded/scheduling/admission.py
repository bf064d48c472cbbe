"""Admission: which waiting requests join the running batch and how their prompts are prefilled.

With a prefix cache (`prefix_cache.py`, on unless the engine turns it off; never for multimodal models,
whose prompt ids do not say what the media were), each admitted prompt first looks up its longest cached
prefix: the hit's blocks go into its block table (shared, by reference) and only the rest is prefilled
(`prefill_after`); the prompt's full blocks are cached after its prefill, and prompt + output when a sample
finishes. The pool evicts the cache's LRU blocks when it needs room, so the cache never keeps a request
out. A prompt that shares two or more uncached blocks with an earlier prompt of the same admission waits
one step for them (`_defer_shared`). `prefill_computed` / `prefill_submitted` count prompt tokens computed
and asked for.

Admission is bounded by `max_running` sequences, by the KV blocks (`max_total_tokens`): a prompt is
admitted when its blocks fit with one spare block per running row, nothing is reserved for tokens not yet
generated, and by `max_prefill_tokens` (padded tokens of one prefill, so a burst of long prompts does not
stall decoding for long; with the packed prefill of `packed_prefill.py`, tokens past the cached prefix,
and the columns gathered at most `PACKED_COLUMNS` times that). A lone request is always admitted. A decode step first gives every row the
block its next token goes to (`_ensure_blocks`); when the pool is out of blocks, the most recently
admitted row is preempted: its blocks are freed (its full blocks cached first) and it goes back to the
front of the queue with its output so far, to be prefilled again (prompt + output) when blocks are free,
so its output is the same as without preemption (greedy and seeded sampling alike).

With chunked prefill (`chunked_prefill.py`, `chunk_size` > 0; text-only models) a prompt whose uncached
part is longer than `chunk_size` is admitted alone and prefilled `chunk_size` tokens a step, the running batch decoding once after each
chunk; it is admitted whenever rows and memory allow, however long (without chunking a prompt longer
than `max_prefill_tokens` waits until nothing runs). A weight load restarts a chunked prefill from the
queue (its KV under one version), an abort or a retract ends it; none leaves a half-prefilled sequence.

A mixin of `Scheduler`: only the engine thread calls it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax.backends.inference.embedded.sampling.sampling import sample_tokens
from relax.backends.inference.embedded.scheduling.chunked_prefill import ChunkedPrefill
from relax.backends.inference.embedded.scheduling.kv_blocks import BlockRows
from relax.backends.inference.embedded.scheduling.logit_rows import LogitRows
from relax.backends.inference.embedded.scheduling.sequence import Sequence

# a packed prefill gathers each prompt's cached columns too: at most this many times the token budget
PACKED_COLUMNS = 16


class Admission(BlockRows):
    def _plan(self) -> tuple[list[list[Sequence]], int]:
        """The prefill units to admit now and how many queue entries they use up (entries whose samples
        have all finished, by an abort, are used up too); the queue is not touched."""
        units: list[list[Sequence]] = []
        rows = len(self.running)
        avail = self.cache.available()  # blocks free, not yet allocated, or held by the prefix cache alone
        longest = 0
        used = 0
        chunk = self.chunk_size
        # The batch's budget stays `max_prefill_tokens` with chunking on: it counts padded prompt lengths,
        # cached prefixes included, so capping it at a chunk admitted one prefix-cache hit a step (the
        # agent-turn benchmark lost a quarter of its throughput). The chunk bounds one long prompt's work.
        budget = self.max_prefill_tokens
        packed = self.runner.packed_prefill and self.prefix is not None
        columns = 0  # a packed prefill's attended columns (`packed_prefill.py` gathers them)
        for entry in self.waiting:
            unit = [s for s in entry if s.finish is None]
            if not unit:
                used += 1
                continue
            need = self._blocks_needed(unit)
            # a packed prefill computes each prompt past its cached prefix, padded to the longest such
            # suffix; the masked and plain ones pad every prompt to the longest prompt
            full = len(unit[0].prefill_ids())
            length = max(longest, self._to_compute(unit[0]) if packed else full)
            long = chunk > 0 and self._to_compute(unit[0]) > chunk  # prefilled in chunks, alone
            if units or self.running or self.inflight:  # else a lone request is always admitted
                # one spare block per row after it: the rows' next tokens
                if rows + len(unit) > self.max_running or need + rows + len(unit) > avail:
                    break
                if units and long:
                    break
                # with chunking the first unit computes at most a chunk a step, whatever its length
                if (units or not chunk) and (len(units) + 1) * length > budget:
                    break
                if units and packed and columns + full > PACKED_COLUMNS * budget:
                    break
            used += 1
            units.append(unit)
            if long:
                break
            rows, avail, longest, columns = rows + len(unit), avail - need, length, columns + full
        return units, used

    def _to_compute(self, seq: Sequence) -> int:
        """Tokens a prefill of `seq` computes: its prompt past the prefix cache's hit."""
        ids = seq.prefill_ids()
        cached = self.prefix.peek(ids, len(ids) - 1, memo=seq) * self.block if self.prefix is not None else 0
        return len(ids) - cached

    def _admissible(self) -> bool:
        return bool(self._plan()[0])

    def _take_units(self) -> list[list[Sequence]]:
        units, used = self._plan()
        for _ in range(used):
            self.waiting.popleft()
        return units

    def _admit(self) -> int:
        units = self._take_units()
        self._admitting = [s for u in units for s in u]
        if self.prefix is not None and len(units) > 1:
            units = self._defer_shared(units)
        if not units:
            return 0
        if self.chunk_size and len(units) == 1 and self._to_compute(units[0][0]) > self.chunk_size:
            return self._start_chunked(units[0])
        base = len(self.running)  # new sequence k goes to table row base + k
        prompts, firsts, starts, k = [], [], [], 0  # firsts: table row of each unit's first sequence
        for i, u in enumerate(units):
            p = u[0].prefill_ids()
            start = self._place(p, base + k, force=not self.running and i == 0, memo=u[0])
            if start is None:  # out of blocks: this unit and the later ones wait
                self.waiting.extendleft(reversed(units[i:]))
                units = units[:i]
                break
            prompts.append(p)
            firsts.append(base + k)
            starts.append(start)
            k += len(u)
        self._admitting = seqs = [s for u in units for s in u]
        if not units:
            return 0
        self.prefill_submitted += sum(len(p) for p in prompts)
        self.prefill_computed += sum(len(p) - st for p, st in zip(prompts, starts, strict=True))
        if self.runner.multimodal:
            media = [u[0].group.multimodal_inputs for u in units]
            logits_UV, deltas = self.runner.prefill_multimodal(prompts, firsts, media)
            for u, d in zip(units, deltas, strict=True):
                u[0].group.rope_delta = d
        else:
            logits_UV = self._prefill(prompts, firsts, starts)
        for u, p, first in zip(units, prompts, firsts, strict=True):
            if self.prefix is not None:
                self.prefix.insert(p, self.cache.rows[first])
            self.cache.copy(first, list(range(first + 1, first + len(u))), len(p))
        rows = [i for i, u in enumerate(units) for _ in u]  # prefill row of each sequence
        return self._join(seqs, logits_UV, rows)

    def _join(self, seqs: list[Sequence], logits_UV: Tensor, rows: list[int]) -> int:
        """Prefilled sequences, already in slots len(running).., join the batch: each one without an
        output samples its first token from prefill row rows[k] of `logits_UV`."""
        fresh = [k for k, s in enumerate(seqs) if not s.output_ids]  # retracted ones hold a next token
        if fresh:
            idx = torch.tensor([rows[k] for k in fresh], device=logits_UV.device)
            firsts_FV = logits_UV.index_select(0, idx)
            special = LogitRows.of([seqs[k] for k in fresh], self.runner.vocab_size, self.runner.device)
            tops: list = [None] * len(fresh)
            if special is not None:
                firsts_FV = special.process(firsts_FV)
                tops = special.top_logprobs(firsts_FV)
            tokens, logprobs = sample_tokens(firsts_FV, [seqs[k].row for k in fresh], self.generator)
            for k, t, lp, top in zip(fresh, tokens, logprobs, tops, strict=True):
                seqs[k].append(t, lp, top)
        self.running.extend(seqs)
        for s in seqs:
            self._order[id(s)] = next(self._joins)
        self._admitting = []
        self.batch = None
        self._drop_finished()
        return len(fresh)

    # -- chunked prefill (`chunked_prefill.py`) ---------------------------------------------------
    def _start_chunked(self, unit: list[Sequence]) -> int:
        """Admit one long prompt: its blocks (a prefix-cache hit's, fresh ones for the rest) in the table row
        past the batch, then prefill its first chunk there."""
        slot = len(self.running)
        ids = unit[0].prefill_ids()
        start = self._place(ids, slot, force=not self.running, memo=unit[0])
        if start is None:
            self.waiting.appendleft(unit)
            self._admitting = []
            return 0
        self.prefill_submitted += len(ids)
        self.prefill_computed += len(ids) - start
        self.chunked = ChunkedPrefill(unit, ids, slot, start, self.chunk_size)
        self._admitting = []
        self.chunked.run(self.runner)  # never the last chunk: the prompt is longer than one
        return 0

    def _next_chunk(self) -> int:
        """Prefill the chunked prompt's next chunk; after its last, its samples join the batch."""
        c = self.chunked
        if not c.last():  # the slot is no running row's: the decode step in flight needs no wait
            c.run(self.runner)
            return 0
        generated = self.drain()  # the batch changes
        logits_1V = c.run(self.runner)
        self._admitting, self.chunked = c.unit, None
        seqs = c.live()
        first = len(self.running)  # the batch only shrank since the prompt was admitted at `c.slot`
        if self.prefix is not None:
            self.prefix.insert(c.ids, self.cache.rows[c.slot])
        if c.slot != first:
            self.cache.move([c.slot], [first], len(c.ids))
        self.cache.copy(first, list(range(first + 1, first + len(seqs))), len(c.ids))
        return generated + self._join(seqs, logits_1V, [0] * len(seqs))

    def _unchunk(self) -> list[Sequence]:
        """Drop the chunked prefill in progress and give back its blocks; returns its samples still
        unfinished."""
        c, self.chunked = self.chunked, None
        if c is None:
            return []
        self.cache.free_row(c.slot)
        return c.live()

    def weights_changed(self) -> None:
        """The weights were loaded: empty the prefix cache, and prefill a chunked prompt again from its
        start (first in the queue), so its KV is all of the new weights."""
        self.flush_prefix()
        live = self._unchunk()
        if live:
            self.waiting.appendleft(live)

    def _prefill(self, prompts: list[list[int]], slots: list[int], starts: list[int]) -> Tensor:
        """Prefill text prompts into their table rows: the misses in one plain prefill, the prefix-cache
        hits (their blocks already in the rows) past their cached prefix in one masked prefill; returns
        the last-token logits [U, V] in prompt order."""
        miss = [u for u, st in enumerate(starts) if st == 0]
        hit = [u for u, st in enumerate(starts) if st > 0]
        if not hit:
            return self.runner.prefill(prompts, slots)
        parts, order = [], []
        if miss:
            parts.append(self.runner.prefill([prompts[u] for u in miss], [slots[u] for u in miss]))
            order += miss
        suffixes = [prompts[u][starts[u] :] for u in hit]
        parts.append(self.runner.prefill_after(suffixes, [slots[u] for u in hit], [starts[u] for u in hit]))
        order += hit
        logits_UV = torch.cat(parts) if len(parts) > 1 else parts[0]
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return logits_UV.index_select(0, back.to(logits_UV.device))

    def flush_prefix(self) -> None:
        """Empty the prefix cache (weights changed, or `/flush_cache`); the sequences running now hold KV
        of the old weights, so theirs is not cached when they finish."""
        if self.prefix is not None:
            self.prefix.clear()
            self._stale = {id(s) for s in self.running}
