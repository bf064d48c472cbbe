"""The running batch's KV cache, paged: one pool of fixed-size blocks per layer and a block table per row.

Layout, per layer: keys and values [NB, H_kv, BLOCK, D] (NB blocks of `BLOCK` tokens), views of one store
[2, layers, NB, H_kv, BLOCK, D]. Row b of the running batch owns table row b: token t of its sequence
(prompt and output alike) lives in block table[b, t // BLOCK] at offset t % BLOCK. So

* memory follows the tokens held: a row holds the blocks of its tokens so far, one more when a decode step
  crosses a block boundary (`extend`); nothing is reserved for tokens not yet generated;
* rows that leave the batch give their blocks back and a row from the end takes the freed table row
  (`move`: integer table rows, no KV copied);
* the n samples of a prompt share its full blocks by reference count (`copy`: only the partial last block,
  which each sample goes on writing, is copied);
* the prefix cache (`prefix_cache.py`) holds references to full blocks of finished and prefilled
  sequences; a hit puts those blocks into the new row's table (`assign`), so nothing is copied.

Block 0 is never handed out: unused table entries point to it, so the padding of a right-padded prefill
and the padding rows of a captured decode graph write there and nothing else. Table row `trash_row` is
all zeros (the graphs' padding rows use it).

The pool grows by doubling (one copy; `generation` is bumped, so captured CUDA graphs, which hold its
address, are dropped) up to `max_blocks`, the engine's `max_total_tokens`; past it `alloc` fails and the
scheduler preempts a row (`scheduler.py`). A device that runs out of memory for a doubling lowers
`max_blocks` to what it holds (or the largest smaller pool that fits), so the same preemption follows, never a failed step.
Only a lone row may grow the pool past the budget (a lone request is always served). The device table is
synced from a host copy before each forward (`sync`): only the rows changed since, through pinned memory
without waiting for the device.

The model sees this object as its cache: `update(k, v, layer)` is the only method it calls. Which rows
and columns an `update` writes is set by `for_prefill` / `for_decode` before each forward.

On the CPU a decode step attends over a contiguous mirror of the running rows' KV ([rows, H_kv, columns,
D] per layer, `_Mirror`), not over the blocks: with no paged kernel there, attending over blocks meant
gathering every row's whole KV out of the pool in every layer at every step, which made the CPU engine a
third slower than the contiguous slots it replaced (docs/measurements.md). The pool stays the truth (the
prefix cache, row moves and fan-out work on blocks); a decode step writes its token to both, and a row
whose blocks changed hands is copied into the mirror once, from the pool, before its next step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from relax.backends.inference.embedded.model.packed_prefill import PackedPrefill

logger = logging.getLogger(__name__)

BLOCK = 16  # tokens per block (a power of two): the prefix cache's granularity too (docs/engines.md)


def _blocks_for(tokens: int, block: int = BLOCK) -> int:
    return -(-tokens // block)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_context: int = 32768,
        max_tokens: int = 1 << 18,
        block: int = BLOCK,
    ) -> None:
        if block & (block - 1):
            raise ValueError(f"KV block size {block} is not a power of two")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device, self.block = dtype, device, block
        self.width = _blocks_for(max_context, block)  # table columns: blocks of the longest sequence
        self.max_blocks = max(_blocks_for(max_tokens, block), 2) + 1  # the budget (+ block 0)
        self.store: Tensor | None = None  # [2, layers, NB, H_kv, BLOCK, D]
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.num_blocks = 0  # NB allocated
        self.refs = np.zeros(0, dtype=np.int32)  # references per block: rows holding it, + 1 if cached
        self.cached = np.zeros(0, dtype=bool)  # the prefix cache holds it
        self.cache_only = 0  # blocks only the prefix cache holds (evictable)
        self.free: list[int] = []
        self.reclaim: Callable[[int], int] | None = None  # the prefix cache's eviction (blocks to free)
        self.rows: list[list[int]] = []  # blocks of each table row, in token order
        self.caps = np.zeros(0, dtype=np.int64)  # tokens each row's blocks hold
        self.host = np.zeros((0, self.width), dtype=np.int32)
        self.table = torch.zeros(0, self.width, dtype=torch.int32, device=device)
        self.trash_row = 0
        self._dirty: set[int] = set()
        self._widest = 0  # the most blocks any row has held (what a sync sends per row)
        self.generation = 0  # bumped on every reallocation (captured graphs hold the old buffers)
        self._arange: Tensor | None = None
        self._rows_t: Tensor | None = None
        self._pos_B: Tensor | None = None
        self._length = 0
        self._cols: Tensor | None = None
        self._prefill = False
        self._step_where: tuple[Tensor, Tensor] | None = None
        self._packed_where: tuple[Tensor, Tensor] | None = None  # block, offset of a packed prefill's columns
        self._mirror = _Mirror() if device.type == "cpu" else None
        self._mirror_rows = 0  # decode rows 0..B-1 attend over the mirror's rows 0..B-1 (0: rows_B given)

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Columns a row may address."""
        return self.width * self.block

    def set_budget(self, max_tokens: int) -> None:
        self.max_blocks = max(_blocks_for(max_tokens, self.block), 2) + 1

    def preallocate(self) -> None:
        """Allocate the whole budget now rather than as tokens arrive: for an engine that shares its GPU
        with a trainer, which plans its memory around what the engine holds when it first runs."""
        self._grow(self.max_blocks)

    def used_blocks(self) -> int:
        """Blocks held by rows or the prefix cache."""
        return max(self.num_blocks - 1, 0) - len(self.free)

    def available(self) -> int:
        """Blocks an allocation could get now: free, not yet allocated, or held by the cache alone."""
        return len(self.free) + max(self.max_blocks - max(self.num_blocks, 1), 0) + self.cache_only

    def row_tokens(self, row: int) -> int:
        return len(self.rows[row]) * self.block if row < len(self.rows) else 0

    # -- allocation ------------------------------------------------------------------------------
    def ensure_rows(self, n: int) -> None:
        """Room for table rows 0..n-1 (and the trash row past them)."""
        if n < len(self.rows):
            return
        new = max(n + 1, 2 * len(self.rows), 8)
        host = np.zeros((new + 1, self.width), dtype=np.int32)
        host[: len(self.rows)] = self.host[: len(self.rows)]
        self.host = host
        self.caps = np.concatenate([self.caps, np.zeros(new - len(self.rows), dtype=np.int64)])
        self.rows += [[] for _ in range(new - len(self.rows))]
        self.trash_row = new
        self.table = torch.from_numpy(host).to(self.device)
        self._dirty.clear()
        self.generation += 1

    def _grow(self, want: int) -> bool:
        have = self.num_blocks
        if want <= have:
            return False
        store = self._new_store(want)
        if self.store is not None:
            store[:, :, :have].copy_(self.store)
        self.store = store
        self.keys, self.values = list(store[0].unbind(0)), list(store[1].unbind(0))
        self.refs = np.concatenate([self.refs, np.zeros(want - have, dtype=np.int32)])
        self.cached = np.concatenate([self.cached, np.zeros(want - have, dtype=bool)])
        self.free.extend(range(want - 1, max(have, 1) - 1, -1))  # pop() hands out low indices first
        self.num_blocks = want
        self.generation += 1
        mib = store.numel() * store.element_size() / 2**20
        logger.debug("KV pool grown to %d blocks of %d tokens (%.0f MiB)", want, self.block, mib)
        return True

    def _new_store(self, blocks: int) -> Tensor:
        L, H, D = self.num_layers, self.num_kv_heads, self.head_dim
        return torch.zeros((2, L, blocks, H, self.block, D), dtype=self.dtype, device=self.device)

    def _grow_within_memory(self, want: int, need: int) -> bool:
        """`_grow` to `want` blocks; where the device cannot hold that pool beside the old one (the copy
        needs both), the largest of a few smaller sizes down to `need` that it can, and that size (or the
        pool's size so far) becomes the budget: past it the scheduler preempts rows as at any full budget.
        Before, the out-of-memory error failed every request in flight (a 1.5B engine's 256 rows of 8k
        tokens asked an 80 GB card for 56 GiB more at a doubling)."""
        try:
            return self._grow(want)
        except torch.OutOfMemoryError:
            pass
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        grown, size = False, want
        while not grown and size > max(need, self.num_blocks + 1):
            size = max(need, (self.num_blocks + size) // 2)
            try:
                grown = self._grow(size)
            except torch.OutOfMemoryError:
                continue
        self.max_blocks = max(self.num_blocks, 1)
        logger.warning(
            "the device could not grow the KV pool to %d blocks of %d tokens; its budget is now %d blocks "
            "(%d tokens), and rows past it are preempted and recomputed: a lower max_total_tokens or "
            "running batch, or more free device memory, avoids the recompute",
            want, self.block, self.max_blocks, self.max_blocks * self.block,
        )  # fmt: skip
        return grown

    def alloc(self, n: int, force: bool = False) -> list[int] | None:
        """n fresh blocks (one reference each), or None when the budget cannot give them. The pool grows
        by doubling up to the budget; past it, blocks only the prefix cache holds are evicted (a few dozen
        at a time: each eviction scans the cache's LRU order). `force`: grow past the budget (a lone row)."""
        while len(self.free) < n:
            short = n - len(self.free)
            want = min(max(2 * self.num_blocks, 64, self.num_blocks + short), self.max_blocks)
            if self._grow_within_memory(want, min(self.num_blocks + short, want)):
                continue
            if self.reclaim and self.cache_only and self.reclaim(max(short, 32)):
                continue
            if force and self._grow(self.num_blocks + short):
                continue
            return None
        out = [self.free.pop() for _ in range(n)]
        self.refs[out] = 1
        return out

    # A row's blocks are distinct, so each list below is; array operations because a prefix-cache hit
    # or a finished row of an agent's history is hundreds of blocks, and a Python loop over numpy
    # scalars took ~0.4 us a block.
    def incref(self, blocks: list[int]) -> None:
        """One more reference to each of `blocks` (distinct)."""
        if not blocks:
            return
        idx = np.asarray(blocks, dtype=np.intp)
        self.cache_only -= int(np.count_nonzero((self.refs[idx] == 1) & self.cached[idx]))
        self.refs[idx] += 1

    def decref(self, blocks: list[int]) -> None:
        """One reference fewer to each of `blocks` (distinct); those left with none are free."""
        if not blocks:
            return
        idx = np.asarray(blocks, dtype=np.intp)
        refs = self.refs[idx] - 1
        self.refs[idx] = refs
        gone = idx[refs == 0]
        if gone.size:
            was_cached = self.cached[gone]
            self.cache_only -= int(np.count_nonzero(was_cached))
            self.cached[gone] = False
            self.free.extend(gone.tolist())
        self.cache_only += int(np.count_nonzero((refs == 1) & self.cached[idx]))

    def hold(self, b: int) -> None:
        """The prefix cache takes a reference to block b (held by a row)."""
        self.cached[b] = True
        self.refs[b] += 1

    def hold_many(self, blocks: list[int]) -> None:
        """`hold` of each of `blocks` (distinct), as array operations."""
        self.cached[blocks] = True
        self.refs[blocks] += 1

    def unhold(self, b: int) -> None:
        """The prefix cache drops its reference to block b."""
        self.cached[b] = False
        r = self.refs[b] - 1
        self.refs[b] = r
        if r == 0:
            self.cache_only -= 1
            self.free.append(b)

    # -- table rows ------------------------------------------------------------------------------
    def _grow_row(self, row: int, new: list[int]) -> None:
        """Append blocks to a row (in place: only the new table entries are written)."""
        blocks = self.rows[row]
        n = len(blocks)
        blocks.extend(new)
        self._widest = max(self._widest, len(blocks))
        self.caps[row] = len(blocks) * self.block
        self.host[row, n : len(blocks)] = new
        self._dirty.add(row)

    def _set_row(self, row: int, blocks: list[int]) -> None:
        old = len(self.rows[row])
        self._widest = max(self._widest, len(blocks))
        self.rows[row] = blocks
        self.caps[row] = len(blocks) * self.block
        if self._mirror is not None:
            self._mirror.forget(row)
        self.host[row, : len(blocks)] = blocks
        if old > len(blocks):
            self.host[row, len(blocks) : old] = 0
        self._dirty.add(row)

    def assign(self, row: int, blocks: list[int]) -> None:
        """Row `row` (empty) starts with `blocks`, shared (a prefix-cache hit): a reference each."""
        self.ensure_rows(row + 1)
        self.incref(blocks)
        self._set_row(row, list(blocks))

    def extend(self, row: int, tokens: int, force: bool = False) -> bool:
        """Give row `row` the blocks to hold `tokens` tokens; False when the budget cannot (nothing
        changes then). `force`: past the budget."""
        self.ensure_rows(row + 1)
        have = self.rows[row]
        need = _blocks_for(tokens, self.block) - len(have)
        if need <= 0:
            return True
        if len(have) + need > self.width:
            raise ValueError(f"{tokens} tokens are past the KV table's {self.capacity} columns")
        got = self.alloc(need, force)
        if got is None:
            return False
        self._grow_row(row, got)
        return True

    def extend_rows(self, rows: list[int], tokens: list[int], force: bool = False) -> bool:
        """`extend` of several rows with one allocation (a decode step's rows that cross a block
        boundary); False when some row could not get its blocks (the others keep theirs)."""
        needs = [_blocks_for(t, self.block) - len(self.rows[r]) for r, t in zip(rows, tokens, strict=True)]
        got = self.alloc(sum(n for n in needs if n > 0), force)
        if got is None:
            return all([self.extend(r, t, force) for r, t in zip(rows, tokens, strict=True)])
        for r, n in zip(rows, needs, strict=True):
            if n > 0:
                if len(self.rows[r]) + n > self.width:
                    raise ValueError(f"a row is past the KV table's {self.capacity} columns")
                self._grow_row(r, got[:n])
                got = got[n:]
        return True

    def free_row(self, row: int) -> None:
        if row < len(self.rows) and self.rows[row]:
            self.decref(self.rows[row])
            self._set_row(row, [])

    def copy(self, src: int, dsts: list[int], length: int) -> bool:
        """Rows `dsts` (empty) continue the first `length` tokens of row `src`: its full blocks shared, its
        partial last block copied (each row writes on into it). False when no block is left for a copy."""
        if not dsts:
            return True
        full, part = divmod(length, self.block)
        shared = self.rows[src][:full]
        self.ensure_rows(max(dsts) + 1)
        copies = self.alloc(len(dsts)) if part else []
        if copies is None:
            copies = self.alloc(len(dsts), force=True)
        for i, d in enumerate(dsts):
            self.incref(shared)
            self._set_row(d, shared + ([copies[i]] if part else []))
        if part:
            idx = torch.tensor(copies, device=self.device)
            self.store[:, :, idx] = self.store[:, :, self.rows[src][full] : self.rows[src][full] + 1]
        return True

    def move(self, srcs: list[int], dsts: list[int], length: int = 0) -> None:
        """Row srcs[i] becomes row dsts[i] (empty): its blocks change hands, no KV is copied."""
        for s, d in zip(srcs, dsts, strict=True):
            blocks = self.rows[s]
            self._set_row(s, [])
            self._set_row(d, blocks)

    def release(self) -> None:
        """Free every block and the pool's memory (a retract, an error); the next allocation starts over."""
        self.store, self.keys, self.values, self.num_blocks = None, [], [], 0
        self.refs, self.cached = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=bool)
        self.cache_only, self.free = 0, []
        for r in range(len(self.rows)):
            if self.rows[r]:
                self._set_row(r, [])
        if self._mirror is not None:
            self._mirror = _Mirror()
        self.generation += 1

    def reserve(self, rows: int, length: int, max_rows: int = 0) -> None:
        """Rows 0..rows-1 hold `length` tokens each, private blocks (tests and benchmarks that call the
        runner directly)."""
        self.ensure_rows(max(rows, max_rows))
        for r in range(rows):
            self.extend(r, length, force=True)

    def sync(self) -> None:
        """Send the table rows changed since the last sync to the device, without waiting for it."""
        if not self._dirty:
            return
        rows = sorted(self._dirty)
        self._dirty.clear()
        W = min(self._widest, self.width)
        vals = torch.from_numpy(self.host[rows, :W])
        idx = torch.tensor(rows, dtype=torch.long)
        if self.device.type == "cuda":
            vals = vals.pin_memory().to(self.device, non_blocking=True)
            idx = idx.pin_memory().to(self.device, non_blocking=True)
        self.table[idx, :W] = vals

    # -- what the next forward writes ------------------------------------------------------------
    def for_prefill(
        self,
        rows: Tensor,
        cols_NT: Tensor | None = None,
        length: int = 0,
        packed: PackedPrefill | None = None,
    ) -> PagedKVCache:
        """The next forward is a prefill of len(rows) right-padded prompts into table rows `rows`. With
        `cols_NT`, the prompts continue prefixes their rows hold already: token t of prompt n goes to
        column cols_NT[n, t], and attention sees the row's first `length` columns, padded to `length` per
        row, or with `packed` each row's own columns one after another ([sum K_u, H_kv, D])."""
        self.sync()
        self._prefill, self._rows_t, self._cols, self._length = True, rows, cols_NT, length
        self._packed_where = None
        if packed is not None:
            self._packed_where = self._where(rows[packed.k_rows], packed.k_cols[:, None])
        return self

    def for_decode(self, pos_B: Tensor, length: int, rows_B: Tensor | None = None) -> PagedKVCache:
        """The next forward decodes rows 0..B-1 (or `rows_B`), writing column pos_B[b] and attending over
        `length` columns."""
        B = pos_B.shape[0]
        self.sync()
        self._prefill, self._pos_B, self._length = False, pos_B, length
        if rows_B is None:
            if self._arange is None or self._arange.shape[0] < B or self._arange.device != pos_B.device:
                self._arange = torch.arange(max(B, len(self.rows)), device=pos_B.device)
            rows_B = self._arange[:B]
            self._mirror_rows = B
        else:
            self._mirror_rows = 0
        self._rows_t = rows_B
        self._step_where = None  # block and offset of each row's new column, found by the first layer
        if self._mirror is not None:
            self._mirror.catch_up(self, rows_B.numpy(), pos_B.numpy(), length)
        return self

    def prefill_buffers(self, layer_idx: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For a prefill that writes the cache itself (`prefill_rope`): the layer's key and value pools,
        the block table and the table row of each prompt."""
        return self.keys[layer_idx], self.values[layer_idx], self.table, self._rows_t

    def decode_buffers(self, layer_idx: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
        """For a decode step that writes the cache itself (`attention_step`): the layer's key and value
        pools, the block table, the table row and column of each row, and the columns attended."""
        return (
            self.keys[layer_idx], self.values[layer_idx], self.table, self._rows_t, self._pos_B, self._length
        )  # fmt: skip

    def _gather(self, buf: Tensor, rows: Tensor, length: int) -> Tensor:
        """Columns 0..length-1 of table rows `rows` as [N, H_kv, length, D] (a copy)."""
        nb = _blocks_for(length, self.block)
        blocks = buf[self.table[rows, :nb].long()]  # [N, nb, H, BLOCK, D]
        N, _, H, _, D = blocks.shape
        return blocks.transpose(1, 2).reshape(N, H, nb * self.block, D)[:, :, :length]

    def _where(self, rows_N: Tensor, cols_NT: Tensor) -> tuple[Tensor, Tensor]:
        """Block and offset of column cols_NT[n, t] of table row rows_N[n]."""
        blk = self.table[rows_N[:, None], torch.div(cols_NT, self.block, rounding_mode="floor")]
        return blk.long(), cols_NT % self.block

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        """Called by every attention layer: store the new keys/values, return what to attend over."""
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        rows = self._rows_t
        if self._prefill:
            T = key_states.shape[2]
            cols = self._cols
            if cols is None:
                cols = torch.arange(T, device=key_states.device)[None, :].expand(rows.shape[0], T)
            blk, off = self._where(rows, cols)
            k_buf[blk, :, off] = key_states.transpose(1, 2)  # [N, T, H_kv, D]
            v_buf[blk, :, off] = value_states.transpose(1, 2)
            if self._cols is None:
                return key_states, value_states  # the prompt attends to itself only
            if self._packed_where is not None:
                blk, off = self._packed_where
                return k_buf[blk[:, 0], :, off[:, 0]], v_buf[blk[:, 0], :, off[:, 0]]  # [sum K, H_kv, D]
            return self._gather(k_buf, rows, self._length), self._gather(v_buf, rows, self._length)
        if self._step_where is None:  # the same for every layer of the step
            blk, off = self._where(rows, self._pos_B[:, None])
            self._step_where = blk[:, 0], off[:, 0]
        blk, off = self._step_where
        k_buf[blk, :, off] = key_states[:, :, 0]
        v_buf[blk, :, off] = value_states[:, :, 0]
        if self._mirror is not None:
            return self._mirror.write(layer_idx, rows, self._pos_B, key_states, value_states,
                                      self._length, self._mirror_rows)  # fmt: skip
        return self._gather(k_buf, rows, self._length), self._gather(v_buf, rows, self._length)


class _Mirror:
    """The CPU decode's contiguous copy of the running rows' KV: [2, layers, R, H_kv, C, D], grown by
    doubling. `valid[r]`: columns 0..valid[r]-1 of table row r are current; a row whose blocks change
    (`PagedKVCache._set_row`) is forgotten and copied again from the pool before its next decode."""

    def __init__(self) -> None:
        self.buf: Tensor | None = None
        self.valid = np.zeros(0, dtype=np.int64)

    def forget(self, row: int) -> None:
        if row < len(self.valid):
            self.valid[row] = 0

    def _fit(self, cache: PagedKVCache, rows: int, cols: int) -> None:
        buf = self.buf
        R, C = (0, 0) if buf is None else (buf.shape[2], buf.shape[4])
        if rows <= R and cols <= C:
            return
        R2, C2 = max(R, rows, 2 * R if rows > R else 0), max(C, cols, 2 * C if cols > C else 0)
        shape = (
            2,
            cache.num_layers,
            R2,
            cache.num_kv_heads,
            -(-C2 // cache.block) * cache.block,
            cache.head_dim,
        )
        new = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
        if buf is not None:
            new[:, :, :R, :, :C] = buf
        self.buf = new
        self.valid = np.concatenate([self.valid, np.zeros(R2 - len(self.valid), dtype=np.int64)])

    def catch_up(self, cache: PagedKVCache, rows: np.ndarray, pos: np.ndarray, length: int) -> None:
        """Before a decode step of `rows` at columns `pos`: copy from the pool the columns each row holds
        but the mirror does not; afterwards the step's own writes (`write`) keep it current."""
        self._fit(cache, int(rows.max()) + 1, length)
        store, B = cache.store, cache.block
        for i in np.flatnonzero(self.valid[rows] < pos):  # rows that changed hands or were prefilled
            r, p, a = int(rows[i]), int(pos[i]), int(self.valid[rows[i]])
            b0 = a // B
            blocks = cache.rows[r][b0 : -(-p // B)]
            src = store[:, :, blocks].transpose(2, 3).flatten(3, 4)  # [2, L, H, nb * BLOCK, D]
            self.buf[:, :, r, :, a:p] = src[:, :, :, a - b0 * B : p - b0 * B]
        self.valid[rows] = pos + 1  # the step writes column pos

    def write(
        self, layer: int, rows: Tensor, pos: Tensor, k: Tensor, v: Tensor, length: int, first_rows: int
    ) -> tuple[Tensor, Tensor]:
        """Write the step's keys/values [B, H, 1, D] at column pos[b] of row rows[b]; return what the rows
        attend over, [B, H, length, D] (a view where the rows are 0..B-1)."""
        keys, values = self.buf[0, layer], self.buf[1, layer]
        keys[rows, :, pos] = k[:, :, 0]
        values[rows, :, pos] = v[:, :, 0]
        if first_rows:
            return keys[:first_rows, :, :length], values[:first_rows, :, :length]
        return keys[rows, :, :length], values[rows, :, :length]
