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

Admission (the prefix cache, the KV budget, chunked prefill) is `admission.py`'s part.

Only the engine thread calls this class.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count

import numpy as np
import torch

from relax.backends.inference.embedded.model.runner import ModelRunner
from relax.backends.inference.embedded.sampling.sampling import (
    BatchSampler,
    make_generator,
    to_lists,
)
from relax.backends.inference.embedded.scheduling.admission import Admission
from relax.backends.inference.embedded.scheduling.chunked_prefill import ChunkedPrefill
from relax.backends.inference.embedded.scheduling.decode_batch import DecodeBatch, InflightStep
from relax.backends.inference.embedded.scheduling.logit_rows import LogitRows
from relax.backends.inference.embedded.scheduling.prefix_cache import PrefixCache
from relax.backends.inference.embedded.scheduling.sequence import RequestGroup, Sequence, resolve_groups
from relax.utils.gc_freeze import collector_paused

logger = logging.getLogger(__name__)


class Scheduler(Admission):
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
        self._held: dict[int, RequestGroup] | None = None  # finished inside `holding_results`

    # -- queue ----------------------------------------------------------------------------------
    def add(self, group: RequestGroup) -> None:
        self.waiting.append(list(group.seqs))

    def idle(self) -> bool:
        """Requests wait and nothing runs."""
        return bool(self.waiting) and not self.running and self.inflight is None and self.chunked is None

    def step_is_full(self) -> bool:
        """Whether the next admission cannot take every waiting request (rows, memory or the prefill
        budget stop it): more arrivals would only wait for a later step."""
        return self._plan()[1] < len(self.waiting)

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
        with collector_paused():  # caching the finished rows' blocks allocates entries that live on
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
        groups = {id(s.group): s.group for s in finished if s.group.done()}
        if self._held is not None:
            self._held |= groups
        else:
            resolve_groups(list(groups.values()), self.runner.weight_version)

    @contextmanager
    def holding_results(self) -> Iterator[None]:
        """Hand the requests that finish inside the block their results only at its end. The engine counts
        a step's tokens and time inside it, so a caller that reads `/metrics` the moment its reply arrives
        sees its own tokens (a run's per-step `rollout/engine_busy_tok_s` is scraped just so)."""
        self._held = {}
        try:
            yield
        finally:
            if self._held is not None:  # None: `fail_all` inside the block failed them
                resolve_groups(list(self._held.values()), self.runner.weight_version)
                self._held = None  # where that raised, they stay held for `fail_all`

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
        groups |= self._held or {}  # finished in the step that failed, not yet handed their results
        self.chunked, self._admitting, self._held = None, [], None
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
