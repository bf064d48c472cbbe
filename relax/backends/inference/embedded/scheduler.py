"""Continuous batching: the waiting queue, the running batch and its KV cache, one step at a time.

Each `step()` first admits waiting requests (one right-padded prefill for all of them, written straight
into their cache slots; the n samples of a prompt share its prefill, the slot copied n - 1 times; each
samples its first token from the prefill's logits), then runs one batched decode step over every running
sequence. Running sequence b lives in cache slot b (see `kv_cache.py`); a sequence that finishes leaves
the batch at once and the last row moves into its slot, so the batch stays dense and nothing is copied
per step.

Between two changes of the batch, a step's inputs are carried over from the last one (the sampled tokens
stay a tensor, positions advance by one) and its sampling parameters stay tensors (`BatchSampler`), so a
decode step does little Python work per row: appending each row's token and checking its finish rules.

Admission is bounded by `max_running` sequences, by `max_total_tokens` (each running sequence reserves
prompt + max_new_tokens, capped at the context length, so the batch never outgrows its budget and nothing
is ever preempted) and by `max_prefill_tokens` (padded tokens of one prefill, so a burst of long prompts
does not stall decoding for long). A lone request is always admitted.

Only the engine thread calls this class.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from relax.backends.inference.embedded.runner import ModelRunner
from relax.backends.inference.embedded.sampling import (
    BatchSampler,
    make_generator,
    sample_tokens,
    to_lists,
)
from relax.backends.inference.embedded.sequence import RequestGroup, Sequence

logger = logging.getLogger(__name__)


@dataclass
class DecodeBatch:
    """The next decode step's inputs for the running batch as it is: built when rows join or leave, then
    advanced by each step (its sampled tokens are the next inputs, one column further)."""

    tokens_B: Tensor  # next input token of each row (on the device)
    pos_B: Tensor  # cache column it is written to
    length: int  # columns attended: max(pos_B) + 1
    delta_B: Tensor | None  # rotary position minus cache column (multimodal models), else None
    sampler: BatchSampler  # the rows' sampling parameters


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_running: int,
        max_total_tokens: int,
        max_prefill_tokens: int,
        seed: int = 0,
    ):
        self.runner = runner
        self.max_running = max_running
        self.max_total_tokens = max_total_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[list[Sequence]] = (
            deque()
        )  # prefill units: the samples of one prompt, or one retracted
        self.running: list[Sequence] = []  # running[b] lives in cache slot b
        self.cache = runner.cache
        self.reserved = 0  # tokens reserved by the running sequences
        self.generator = make_generator(seed, runner.device)  # noise of the unseeded requests
        self.batch: DecodeBatch | None = None  # inputs of the next decode step; None: build them anew

    # -- queue ----------------------------------------------------------------------------------
    def add(self, group: RequestGroup) -> None:
        self.waiting.append(list(group.seqs))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting(self) -> int:
        return sum(len(u) for u in self.waiting)

    def kv_tokens(self) -> int:
        return sum(s.num_tokens - 1 for s in self.running)

    def _reserve(self, seq: Sequence) -> int:
        g = seq.group
        return min(len(g.prompt) + g.params.max_new_tokens, g.max_context_len)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> int:
        """Admit, then decode once; returns how many tokens were generated."""
        generated = self._admit()
        if self.running:
            generated += self._decode()
        return generated

    def _take_units(self) -> list[list[Sequence]]:
        units: list[list[Sequence]] = []
        rows = len(self.running)
        reserved = self.reserved
        longest = 0
        while self.waiting:
            unit = [s for s in self.waiting[0] if s.finish is None]
            if not unit:
                self.waiting.popleft()
                continue
            need = sum(self._reserve(s) for s in unit)
            length = max(longest, len(unit[0].prefill_ids()))
            if units or self.running:
                if rows + len(unit) > self.max_running or reserved + need > self.max_total_tokens:
                    break
                if (len(units) + 1) * length > self.max_prefill_tokens:
                    break
            self.waiting.popleft()
            units.append(unit)
            rows, reserved, longest = rows + len(unit), reserved + need, length
        return units

    def _admit(self) -> int:
        units = self._take_units()
        if not units:
            return 0
        seqs = [s for u in units for s in u]
        base = len(self.running)  # new sequence k goes to slot base + k
        need = max(self._reserve(s) for s in seqs)
        self.cache.reserve(base + len(seqs), need, self.max_running)
        firsts, k = [], 0  # slot of each unit's first sequence
        for u in units:
            firsts.append(base + k)
            k += len(u)
        prompts = [u[0].prefill_ids() for u in units]
        if self.runner.multimodal:
            media = [u[0].group.multimodal_inputs for u in units]
            logits_UV, deltas = self.runner.prefill_multimodal(prompts, firsts, media)
            for u, d in zip(units, deltas, strict=True):
                u[0].group.rope_delta = d
        else:
            logits_UV = self.runner.prefill(prompts, firsts)
        for u, first in zip(units, firsts, strict=True):
            self.cache.copy(first, list(range(first + 1, first + len(u))), len(u[0].prefill_ids()))
        rows = [i for i, u in enumerate(units) for _ in u]  # prefill row of each sequence
        fresh = [k for k, s in enumerate(seqs) if not s.output_ids]  # retracted ones hold a next token
        if fresh:
            idx = torch.tensor([rows[k] for k in fresh], device=logits_UV.device)
            tokens, logprobs = sample_tokens(
                logits_UV.index_select(0, idx), [seqs[k].row for k in fresh], self.generator
            )
            for k, t, lp in zip(fresh, tokens, logprobs, strict=True):
                seqs[k].append(t, lp)
        for s in seqs:
            self.running.append(s)
            self.reserved += self._reserve(s)
        self.batch = None
        self._drop_finished()
        return len(fresh)

    def _decode(self) -> int:
        running = self.running
        batch = self.batch if self.batch is not None else self._new_batch()
        logits_BV = self.runner.decode(batch.tokens_B, batch.pos_B, batch.length, batch.delta_B)
        tokens_B, logp_B = batch.sampler.sample(logits_BV, self.generator)
        new_tokens, logprobs = to_lists(tokens_B, logp_B)
        for s, t, lp in zip(running, new_tokens, logprobs, strict=True):
            s.append(t, lp)
        batch.tokens_B, batch.pos_B, batch.length = tokens_B, batch.pos_B + 1, batch.length + 1
        self.batch = batch
        self._drop_finished()  # a row that leaves clears self.batch
        return len(new_tokens)

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
        return DecodeBatch(tokens_B, pos_B, max(positions) + 1, delta_B, sampler)

    # -- leaving the batch ----------------------------------------------------------------------
    def _drop_finished(self) -> None:
        """Remove finished rows, moving the last row into each freed slot (the batch stays dense)."""
        finished = [s for s in self.running if s.finish is not None]
        if not finished:
            return
        self.batch = None
        rows = self.running
        b = 0
        while b < len(rows):
            if rows[b].finish is None:
                b += 1
                continue
            last = len(rows) - 1
            if last != b:  # a finished row moved in is looked at again
                self.cache.move(last, b, rows[last].num_tokens)
                rows[b] = rows[last]
            rows.pop()
        for s in finished:
            self.reserved -= self._reserve(s)
        self._finalize(finished)

    def _finalize(self, finished: list[Sequence]) -> None:
        for group in {id(s.group): s.group for s in finished}.values():
            if group.done():
                group.resolve(self.runner.weight_version)

    def abort(self, rid: str | None, message: str = "aborted") -> int:
        """End the matching requests (all when `rid` is None); they return what they have so far."""
        hit: list[Sequence] = []
        for s in [s for u in self.waiting for s in u] + self.running:
            if s.finish is None and (rid is None or rid in (s.group.rid, s.rid)):
                s.abort(message)
                hit.append(s)
        self.waiting = deque(u for u in self.waiting if any(s.finish is None for s in u))
        self._drop_finished()
        self._finalize(hit)
        return len({id(s.group) for s in hit})

    def note_version(self, old: str, new: str) -> None:
        """The weights changed from `old` to `new` between two steps: every unresolved sample records
        where its tokens under `new` begin (it reports all its versions when it finishes)."""
        seqs = [*self.running, *(s for u in self.waiting for s in u)]
        for group in {id(s.group): s.group for s in seqs}.values():
            for s in group.seqs:
                s.note_version(old, new)

    def retract(self) -> int:
        """Move every running sequence back to the front of the queue, dropping the KV cache; they are
        prefilled again (prompt + output so far) when admitted."""
        n = len(self.running)
        for s in reversed(self.running):
            self.waiting.appendleft([s])
        self.running, self.reserved, self.batch = [], 0, None
        self.cache.release()
        return n

    def fail_all(self, error: BaseException) -> None:
        """After an internal error: fail every request so no caller waits forever."""
        groups = {id(s.group): s.group for s in [s for u in self.waiting for s in u] + self.running}
        for g in groups.values():
            if not g.future.done():
                g.future.set_exception(error)
        self.waiting.clear()
        self.running, self.reserved, self.batch = [], 0, None
