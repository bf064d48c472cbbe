"""Continuous batching: the waiting queue, the running batch and its KV cache, one step at a time.

Each `step()` first admits waiting requests (one right-padded prefill for all of them, written straight
into their KV blocks; the n samples of a prompt share its prefill and its full blocks, each samples its
first token from the prefill's logits), then runs one batched decode step over every running sequence.
Running sequence b owns block-table row b (see `paged_kv_cache.py`); a sequence that finishes leaves the
batch at once, gives its blocks back, and a running row from the end of the batch takes its table row (a
table row moved, no KV copied), so the batch stays dense.

Between two changes of the batch, a step's inputs are carried over from the last one (the sampled tokens
stay a tensor, positions advance by one) and its sampling parameters stay tensors (`BatchSampler`), so a
decode step does little Python work per row: appending each row's token and checking its finish rules.

On CUDA the decode steps overlap the host's work (`overlap`): step k + 1 is launched from step k's sampled
tokens, still on the device, before the host reads step k's tokens, appends them and checks the finish
rules, so the GPU does not wait for that Python work (docs/measurements.md). A row that
finished at step k has then been decoded once more: that token is dropped, and its cache column lies in
a block of its own past its cached ones (stream order puts that write before any later owner's). The in-flight step's rows stay in its launch order (`InflightStep.seqs`); when rows leave,
the next step's inputs are gathered from its tokens in the new order. Admission, and every command that
changes weights, the cache or the batch (`drain`), first wait for the step in flight. On the CPU a step
computes as it is called, so there is nothing to overlap and steps run one at a time.

Rows of constrained requests (a grammar or a logit bias) and of requests that want top log-probs are
`special` (`logit_rows.py`): a batch that holds one runs its decode steps one at a time (the next grammar
mask needs the token just sampled) and changes those rows' logits before sampling. A batch without one
runs exactly as before.

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
stall decoding for long). A lone request is always admitted. A decode step first gives every row the
block its next token goes to (`_ensure_blocks`); when the pool is out of blocks, the most recently
admitted row is preempted: its blocks are freed (its full blocks cached first) and it goes back to the
front of the queue with its output so far, to be prefilled again (prompt + output) when blocks are free,
so its output is the same as without preemption (greedy and seeded sampling alike).

With chunked prefill (`chunked_prefill.py`, `chunk_size` > 0; text-only models) a prompt whose uncached
part is longer than `chunk_size` is admitted alone and prefilled `chunk_size` tokens a step, the running batch decoding once after each
chunk; it is admitted whenever rows and memory allow, however long (without chunking a prompt longer
than `max_prefill_tokens` waits until nothing runs). A weight load restarts a chunked prefill from the
queue (its KV under one version), an abort or a retract ends it; none leaves a half-prefilled sequence.

Only the engine thread calls this class.
"""

from __future__ import annotations

import logging
from collections import deque
from itertools import count

import numpy as np
import torch
from torch import Tensor

from relax.backends.inference.embedded.model.runner import ModelRunner
from relax.backends.inference.embedded.sampling.sampling import (
    BatchSampler,
    make_generator,
    sample_tokens,
    to_lists,
)
from relax.backends.inference.embedded.scheduling.chunked_prefill import ChunkedPrefill
from relax.backends.inference.embedded.scheduling.decode_batch import DecodeBatch, InflightStep
from relax.backends.inference.embedded.scheduling.kv_blocks import BlockRows
from relax.backends.inference.embedded.scheduling.logit_rows import LogitRows
from relax.backends.inference.embedded.scheduling.prefix_cache import PrefixCache
from relax.backends.inference.embedded.scheduling.sequence import RequestGroup, Sequence

logger = logging.getLogger(__name__)


class Scheduler(BlockRows):
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_running: int,
        max_total_tokens: int,
        max_prefill_tokens: int,
        seed: int = 0,
        overlap: bool | None = None,
        prefix_cache: bool = True,
        chunk_size: int = 0,
    ):
        """`overlap`: launch each decode step before reading the last one back (None: on CUDA).
        `prefix_cache`: reuse the KV of prefixes seen before (`prefix_cache.py`; text-only models).
        `chunk_size`: prefill tokens a step, longer prompts in chunks (`chunked_prefill.py`; 0: off)."""
        self.runner = runner
        self.max_running = max_running
        self.max_total_tokens = max_total_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[list[Sequence]] = (
            deque()
        )  # prefill units: the samples of one prompt, or one retracted
        self.running: list[Sequence] = []  # running[b] lives in cache slot b
        self.cache = runner.cache
        self.cache.set_budget(max_total_tokens)
        self.cache.ensure_rows(max_running + 1)  # sized once: captured graphs hold the table
        self.block = self.cache.block
        self._order: dict[int, int] = {}  # id() of a running sequence -> when it joined (preemption: LIFO)
        self._joins = count()
        self.preempted = 0  # sequences preempted for want of KV blocks
        self.generator = make_generator(seed, runner.device)  # noise of the unseeded requests
        self.batch: DecodeBatch | None = None  # inputs of the next decode step; None: build them anew
        self.overlap = runner.device.type == "cuda" if overlap is None else overlap
        self.inflight: InflightStep | None = None  # the step launched and not yet read back (overlap)
        self.prefix: PrefixCache | None = None
        if prefix_cache and not runner.multimodal:
            self.prefix = PrefixCache(self.cache)
        self._stale: set[int] = set()  # id() of running sequences admitted before the last flush
        # sequences taken from the queue and not yet running: a step that fails admitting them fails them
        # too (`fail_all`), rather than leaving their callers waiting forever
        self._admitting: list[Sequence] = []
        self.chunk_size = chunk_size if chunk_size > 0 and not runner.multimodal else 0
        self.chunked: ChunkedPrefill | None = None  # the prompt part way through a chunked prefill
        self.prefill_computed = 0  # prompt tokens run through a prefill (n samples of a prompt: once)
        self.prefill_submitted = 0  # prompt tokens admitted (likewise once per prompt)

    # -- queue ----------------------------------------------------------------------------------
    def add(self, group: RequestGroup) -> None:
        self.waiting.append(list(group.seqs))

    def idle(self) -> bool:
        """Requests wait and nothing runs."""
        return bool(self.waiting) and not self.running and self.inflight is None and self.chunked is None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.inflight or self.chunked)

    def num_waiting(self) -> int:
        chunked = len(self.chunked.live()) if self.chunked is not None else 0
        return sum(len(u) for u in self.waiting) + chunked

    def kv_tokens(self) -> int:
        chunked = self.chunked.done if self.chunked is not None else 0
        return sum(s.num_tokens - 1 for s in self.running) + chunked

    def step(self) -> int:
        """Admit, then decode once; returns how many tokens were generated (read back, with `overlap`:
        the tokens of the step before)."""
        generated = 0
        if self.chunked is not None:
            generated += self._next_chunk()
        elif self.waiting and self._admissible():
            generated += self.drain()
            generated += self._admit()
        if not self.overlap or self._has_special():
            generated += self.drain()
            generated += self._ensure_blocks()
            return generated + (self._decode() if self.running else 0)
        prev = self.inflight
        if self.running and not (prev is not None and all(s.ends_by_length_next() for s in prev.seqs)):
            generated += self._ensure_blocks()  # may read the step in flight back first
            prev = self.inflight
            self.inflight = self._launch() if self.running else None
        else:
            self.inflight = None
        if prev is not None:
            generated += self._read_back(prev)
        return generated

    def drain(self) -> int:
        """Read back the step in flight, if any (before anything changes the batch, cache or weights)."""
        prev, self.inflight = self.inflight, None
        if prev is None:
            return 0
        self.batch = None  # its inputs were the in-flight step's tokens
        return self._read_back(prev)

    def _has_special(self) -> bool:
        """A running row needs its logits changed or read (checked per row only when the batch changed)."""
        if self.batch is not None:
            return self.batch.special is not None
        return any(s.special for s in self.running)

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
        for entry in self.waiting:
            unit = [s for s in entry if s.finish is None]
            if not unit:
                used += 1
                continue
            need = self._blocks_needed(unit)
            length = max(longest, len(unit[0].prefill_ids()))
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
            used += 1
            units.append(unit)
            if long:
                break
            rows, avail, longest = rows + len(unit), avail - need, length
        return units, used

    def _to_compute(self, seq: Sequence) -> int:
        """Tokens a prefill of `seq` computes: its prompt past the prefix cache's hit."""
        ids = seq.prefill_ids()
        cached = self.prefix.peek(ids, len(ids) - 1) * self.block if self.prefix is not None else 0
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
            start = self._place(p, base + k, force=not self.running and i == 0)
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
        start = self._place(ids, slot, force=not self.running)
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

    def _decode(self) -> int:
        running = self.running
        batch = self.batch if self.batch is not None else self._new_batch()
        logits_BV = self.runner.decode(batch.tokens_B, batch.pos_B, batch.length, batch.delta_B)
        special = batch.special
        if special is not None:
            logits_BV = special.process(logits_BV)
        tokens_B, logp_B = batch.sampler.sample(logits_BV, self.generator)
        new_tokens, logprobs = to_lists(tokens_B, logp_B)
        if special is None:
            for s, t, lp in zip(running, new_tokens, logprobs, strict=True):
                s.append(t, lp)
        else:
            tops = special.top_logprobs(logits_BV)
            for s, t, lp, top in zip(running, new_tokens, logprobs, tops, strict=True):
                s.append(t, lp, top)
        batch.tokens_B, batch.pos_B, batch.length = tokens_B, batch.pos_B + 1, batch.length + 1
        batch.cols += 1
        self.batch = batch
        self._drop_finished()  # a row that leaves clears self.batch
        return len(new_tokens)

    def _launch(self) -> InflightStep:
        """Launch one decode step of the running batch; its tokens become the next step's inputs."""
        batch = self.batch if self.batch is not None else self._new_batch()
        logits_BV = self.runner.decode(batch.tokens_B, batch.pos_B, batch.length, batch.delta_B)
        tokens_B, logp_B = batch.sampler.sample(logits_BV, self.generator)
        both = torch.stack([tokens_B.double(), logp_B.double()])
        event = None
        if both.device.type == "cuda":
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = both.cpu()
        batch.tokens_B, batch.pos_B, batch.length = tokens_B, batch.pos_B + 1, batch.length + 1
        batch.cols += 1
        self.batch = batch
        return InflightStep(list(self.running), tokens_B, host, event)

    def _read_back(self, step: InflightStep) -> int:
        """Append a launched step's tokens to its rows still running; drop the rows that finish."""
        tokens, logprobs = step.read()
        n = 0
        for s, t, lp in zip(step.seqs, tokens, logprobs, strict=True):
            if s.finish is None:
                s.append(t, lp)
                n += 1
        self._drop_finished()
        return n

    def _regather(self, before: list[Sequence]) -> None:
        """Rows left the batch while a step is in flight: the next step's inputs in the new row order,
        gathered from the in-flight step's tokens (the host does not know them yet)."""
        batch = self.batch
        if batch is None or not self.running:
            self.batch = None
            return
        where = {id(s): i for i, s in enumerate(before)}
        order = [where[id(s)] for s in self.running]
        idx = torch.tensor(order, device=batch.tokens_B.device)
        # the rows left may be shorter than the longest that left: carried on, `length` would grow past
        # the cache's capacity (each row's next column is at most its num_tokens)
        length = min(batch.length, max(s.num_tokens for s in self.running) + 1)
        self.batch = DecodeBatch(
            batch.tokens_B.index_select(0, idx),
            batch.pos_B.index_select(0, idx),
            length,
            None if batch.delta_B is None else batch.delta_B.index_select(0, idx),
            BatchSampler([s.row for s in self.running], self.runner.device),
            cols=batch.cols[order],
        )

    def _new_batch(self) -> DecodeBatch:
        running = self.running
        device = self.runner.device
        positions = [s.num_tokens - 1 for s in running]
        tokens_pos_2B = torch.tensor([[s.output_ids[-1] for s in running], positions], dtype=torch.long)
        tokens_B, pos_B = tokens_pos_2B.to(device).unbind(0)
        delta_B = None
        if self.runner.multimodal:
            delta_B = torch.tensor([s.group.rope_delta for s in running], dtype=torch.long).to(device)
        sampler = BatchSampler([s.row for s in running], device)
        special = LogitRows.of(running, self.runner.vocab_size, device)
        cols = np.array(positions, dtype=np.int64)
        return DecodeBatch(tokens_B, pos_B, max(positions) + 1, delta_B, sampler, special, cols)

    # -- leaving the batch ----------------------------------------------------------------------
    def _drop_finished(self) -> None:
        """Remove finished rows; running rows from the end of the batch move into the slots they free
        (one batched cache copy), so the batch stays dense and no finished row is ever moved."""
        rows = self.running
        finished = [s for s in rows if s.finish is not None]
        if not finished:
            return
        before = list(rows)
        for b, s in enumerate(rows):
            if s.finish is not None:
                self._cache_row(s, b)
                self.cache.free_row(b)
                self._order.pop(id(s), None)
        keep = len(rows) - len(finished)
        holes = [b for b in range(keep) if rows[b].finish is not None]
        movers = [b for b in range(keep, len(rows)) if rows[b].finish is None]
        self.cache.move(movers, holes)
        for hole, mover in zip(holes, movers, strict=True):
            rows[hole] = rows[mover]
        del rows[keep:]
        if self.inflight is not None:
            self._regather(before)
        else:
            self.batch = None
        self._finalize(finished)

    def _finalize(self, finished: list[Sequence]) -> None:
        for group in {id(s.group): s.group for s in finished}.values():
            if group.done():
                group.resolve(self.runner.weight_version)

    def abort(self, rid: str | None, message: str = "aborted") -> int:
        """End the matching requests (all when `rid` is None); they return what they have so far."""
        hit: list[Sequence] = []
        chunked = self.chunked.unit if self.chunked is not None else []
        for s in [s for u in self.waiting for s in u] + self.running + chunked:
            if s.finish is None and (rid is None or rid in (s.group.rid, s.rid)):
                s.abort(message)
                hit.append(s)
        self.waiting = deque(u for u in self.waiting if any(s.finish is None for s in u))
        if self.chunked is not None and not self.chunked.live():  # the last sample ended: its blocks back
            self._unchunk()
        self._drop_finished()
        self._finalize(hit)
        return len({id(s.group) for s in hit})

    def note_version(self, old: str, new: str) -> None:
        """The weights changed from `old` to `new` between two steps: every unresolved sample records
        where its tokens under `new` begin (it reports all its versions when it finishes)."""
        chunked = self.chunked.unit if self.chunked is not None else []
        seqs = [*self.running, *(s for u in self.waiting for s in u), *chunked]
        for group in {id(s.group): s.group for s in seqs}.values():
            for s in group.seqs:
                s.note_version(old, new)

    def retract(self) -> int:
        """Move every running sequence back to the front of the queue, dropping the KV cache; they are
        prefilled again (prompt + output so far) when admitted."""
        n = len(self.running)
        live = self._unchunk()  # admitted after the running ones, before the queue
        if live:
            self.waiting.appendleft(live)
        for s in reversed(self.running):
            self.waiting.appendleft([s])
        self.running, self.batch, self.inflight = [], None, None
        self._stale.clear()  # prefilled again when admitted
        self._order.clear()
        if self.prefix is not None:  # a retract frees the KV memory, the cache's too
            self.prefix.release()
        self.cache.release()
        return n

    def fail_all(self, error: BaseException) -> None:
        """After an internal error: fail every request so no caller waits forever."""
        chunked = self.chunked.unit if self.chunked is not None else []
        queued = [s for u in self.waiting for s in u]
        groups = {id(s.group): s.group for s in queued + self.running + chunked + self._admitting}
        self.chunked, self._admitting = None, []
        for g in groups.values():
            if not g.future.done():
                g.future.set_exception(error)
        self.waiting.clear()
        self.running, self.batch, self.inflight = [], None, None
        self._stale.clear()
        self._order.clear()
        if self.prefix is not None:  # the error may have left any block half written
            self.prefix.release()
        self.cache.release()
