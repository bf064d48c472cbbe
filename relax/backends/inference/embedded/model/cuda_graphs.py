"""CUDA graphs of the decode step: one captured forward per (batch bucket, length bucket), replayed with
static input buffers, so a step costs one launch on the host instead of ~25 per layer.

A step of B rows attending over L cache columns runs the graph of (B', L'): B' = B rounded up to a batch
bucket, L' = L rounded up to a length bucket (`bucket`: at most 4 sizes per doubling, so the padding
wastes at most a quarter). Padding rows decode token 0 at column 0 of the cache's trash row, whose table
entries all point to block 0, which no sequence holds, and their logits are dropped; padding columns are
masked out. The block table is a graph input like the tokens: its contents change between replays, its
address does not. The graphs hold the cache's pool and table, so they are dropped when the cache
reallocates (`PagedKVCache.generation`), and the model's weights, which are updated in place.

A multimodal model's step takes one more input, each row's rope delta (rotary position minus cache column,
set by its prompt's mrope prefill; 0 for a text prompt): a static buffer like the tokens, filled every
step, zero on padding rows (`rope_delta`; text-only models capture without it).

A bucket seen for the first time replays the smallest captured graph that covers it (no fewer rows and
columns; `stand_in`) rather than capturing, until it has been asked for `CAPTURE_AFTER` times: the
partial batches of an admission (rows arriving over a few steps, at the next turn of 64 agent sessions)
each ask for a shape once or twice, and a capture (~10 ms) costs several steps, while replaying a graph
of more rows or columns costs a fraction of one (the extra rows decode in the trash row, the extra columns
lie past every row's length). A shape that stays gets its own graph on its third step.

Capture happens on first use of a bucket that nothing covers (or its third use), on one side stream (the first capture is preceded by one eager
run there, so lazy initialisation stays out of the graphs). That eager run is the step's real inputs: a
decode step is idempotent (it writes the same keys and values to the same columns), so running it again
on replay is harmless.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

# forward(tokens_B, pos_B, rows_B, length, rope_delta_B or None) -> logits [B, V]: one decode step of rows
# `rows_B` of the cache, row b at rotary position pos_B[b] + rope_delta_B[b]
DecodeForward = Callable[[Tensor, Tensor, Tensor, int, Tensor | None], Tensor]

CAPTURE_AFTER = 3  # requests of an uncaptured bucket that a larger graph stands in for before its capture


def bucket(n: int, smallest: int) -> int:
    """n rounded up to a multiple of max(smallest, 2^floor(log2(n - 1)) / 4): 4 sizes per doubling."""
    if n <= smallest:
        return smallest
    step = max(smallest, (1 << (n - 1).bit_length() - 1) // 4)
    return -(-n // step) * step


def stand_in(captured: Iterable[tuple[int, int]], rows: int, columns: int) -> tuple[int, int] | None:
    """The captured (rows, columns) bucket that covers (`rows`, `columns`) at the least cost, or None:
    the fewest rows (the products' work follows them), then the fewest columns."""
    covering = [key for key in captured if key[0] >= rows and key[1] >= columns]
    return min(covering) if covering else None


class DecodeGraphs:
    def __init__(
        self,
        forward: DecodeForward,
        cache,
        device: torch.device,
        max_batch: int = 512,
        rope_delta: bool = False,
    ) -> None:
        """`rope_delta`: the step takes each row's rope delta (a multimodal model)."""
        self.forward = forward
        self.cache = cache  # PagedKVCache
        self.device = device
        self.max_batch = max_batch  # larger batches run eagerly
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.generation = -1  # cache generation the graphs were captured on
        self.pool = None
        self.tokens = self.pos = self.rows = self.arange = torch.empty(0)
        self.rope_delta = rope_delta
        self.delta: Tensor | None = None  # [rows] each row's rope delta, with `rope_delta`
        self._padded = 0  # rows below this may point to the trash row (the last padded replay)
        self._asked: dict[tuple[int, int], int] = {}  # uncaptured bucket -> times a graph stood in for it
        self.stood_in = 0  # replays of a larger graph for an uncaptured bucket (a capture each avoided)
        self.stream: torch.cuda.Stream | None = None  # captures run here (one stream: one cuBLAS workspace)

    def supports(self, batch: int) -> bool:
        return batch <= self.max_batch

    def _reset(self) -> None:
        """Drop the graphs (the cache was reallocated) and size the static inputs to the cache's rows."""
        self.graphs.clear()
        self._asked.clear()
        self.pool = None
        S = self.cache.trash_row
        self.tokens = torch.zeros(S, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(S, dtype=torch.long, device=self.device)
        self.rows = torch.arange(S, device=self.device)
        self.arange = torch.arange(S, device=self.device)
        self.delta = torch.zeros(S, dtype=torch.long, device=self.device) if self.rope_delta else None
        self._padded = 0
        self.generation = self.cache.generation

    def drop(self) -> None:
        """Drop the graphs: the next step captures afresh (what the forward reads on the host changed)."""
        self.generation = -1

    def run(self, tokens_B: Tensor, pos_B: Tensor, length: int, rope_delta_B: Tensor | None = None) -> Tensor:
        """The decode step of rows 0..B-1 (token b at column pos_B[b], rotary position pos_B[b] +
        rope_delta_B[b], `length` columns); logits [B, V]."""
        if rope_delta_B is not None and not self.rope_delta:
            raise ValueError("these decode graphs take no rope delta (built for a text-only model)")
        self.cache.sync()
        if self.generation != self.cache.generation:
            self._reset()
        B = tokens_B.shape[0]
        key = (min(bucket(B, 8), self.cache.trash_row), min(bucket(length, 128), self.cache.capacity))
        if key not in self.graphs:
            key = self._stand_in_or_capture(key)
        Bp = key[0]
        self.tokens[:B].copy_(tokens_B, non_blocking=True)
        self.pos[:B].copy_(pos_B, non_blocking=True)
        if self.delta is not None:
            if rope_delta_B is None:
                self.delta[:B].zero_()
            else:
                self.delta[:B].copy_(rope_delta_B, non_blocking=True)
        if self._padded > 0:  # the last replay's padding rows pointed to the trash row
            self.rows[: self._padded].copy_(self.arange[: self._padded])
            self._padded = 0
        if Bp > B:
            self.tokens[B:Bp].zero_()
            self.pos[B:Bp].zero_()
            if self.delta is not None:
                self.delta[B:Bp].zero_()
            self.rows[B:Bp].fill_(self.cache.trash_row)  # writes go to block 0, held by no sequence
            self._padded = Bp
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, logits_BV = self.graphs[key]
        graph.replay()
        return logits_BV[:B]

    def _stand_in_or_capture(self, key: tuple[int, int]) -> tuple[int, int]:
        """The bucket whose graph runs an uncaptured `key`: a captured larger one while `key` is new
        (`stand_in`), else `key` itself, to be captured."""
        asked = self._asked.get(key, 0) + 1
        larger = stand_in(self.graphs, *key) if asked < CAPTURE_AFTER else None
        if larger is None:
            self._asked.pop(key, None)
            return key
        self._asked[key] = asked
        self.stood_in += 1
        return larger

    def _capture(self, B: int, L: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """The graph of the step of B rows over L columns on the static inputs, and its logits [B, V]."""
        delta = None if self.delta is None else self.delta[:B]
        captured = self._record((self.tokens[:B], self.pos[:B], self.rows[:B], L, delta))
        logger.debug("captured the decode graph of batch %d, length %d", B, L)
        return captured

    def _record(self, args: tuple) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """Capture `forward(*args)`: the only part of a replayed step that needs CUDA."""
        main = torch.cuda.current_stream(self.device)
        if self.stream is None:
            self.stream = side = torch.cuda.Stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self.forward(*args)  # lazy initialisation (cuBLAS handle, workspace) stays out of graphs
            main.wait_stream(side)
        side = self.stream
        side.wait_stream(main)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than `torch.cuda.graph`, which synchronizes and empties the allocator's
        # cache on entry; "thread_local": other threads may use CUDA meanwhile
        with torch.cuda.stream(side):
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                logits_BV = self.forward(*args)
            finally:
                graph.capture_end()
        return graph, logits_BV
