"""Column view of a step's samples, as trainer roles consume it, and padding into tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from itertools import chain, islice

import numpy as np
import torch


@dataclass
class TrainBatch:
    """One training step's data. Every list has one entry per sample; token lists are ragged."""

    prompt_ids: list[list[int]]  # [N][P_i] prompt tokens
    response_ids: list[list[int]]  # [N][R_i] response tokens
    loss_mask: list[list[float]]  # [N][R_i] 1 = trained token, 0 = environment/masked token
    rollout_log_probs: list[list[float]]  # [N][R_i] behaviour log-probs reported by the engine
    rewards: list[float]  # [N] scalar reward per sample (Rollout)
    group_index: list[int]  # [N] prompt-group id; samples of one prompt share it
    weight_versions: list[int]  # [N] oldest weight version that generated the sample
    # Filled by ActorFwd / Reference / Advantages (or in-process on the Actor):
    old_log_probs: list[torch.Tensor] | None = None  # [N][R_i] policy log-probs before the update
    ref_log_probs: list[torch.Tensor] | None = None  # [N][R_i] frozen reference log-probs
    advantages: list[torch.Tensor] | None = None  # [N][R_i] per-token advantages
    returns: list[torch.Tensor] | None = None  # [N][R_i] value targets (critic algorithms)
    # [N] media tensors per sample (Sample.multimodal_inputs); None when every sample is text-only
    multimodal_inputs: list[dict[str, torch.Tensor] | None] | None = None
    extras: dict[str, list] = field(default_factory=dict)

    def media_rows(self, idx: list[int]) -> list[dict[str, torch.Tensor] | None] | None:
        """The media tensors of rows `idx`, or None when none of them has any."""
        if self.multimodal_inputs is None:
            return None
        rows = [self.multimodal_inputs[i] for i in idx]
        return rows if any(rows) else None

    def __len__(self) -> int:
        return len(self.response_ids)

    def subset(self, idx: list[int]) -> TrainBatch:
        """The rows `idx` of this batch, in that order: every per-sample column, extras included."""

        def pick(rows: list | None) -> list | None:
            return None if rows is None else ragged([rows[i] for i in idx])

        columns = {f.name: pick(getattr(self, f.name)) for f in fields(self) if f.name != "extras"}
        return TrainBatch(**columns, extras={k: pick(v) for k, v in self.extras.items()})

    def seq_lens(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids, strict=True)]

    def response_lens(self) -> list[int]:
        return [len(r) for r in self.response_ids]


class Ragged(list):
    """Per-sample 1-D tensors (a list) that cross process boundaries as one flat tensor and the lengths:
    pickled one by one, a step's worth of small tensors cost a tenth of a second of CPU each way (Ray
    moves batches and results between the Actor and its ranks; docs/gpus.md)."""

    def __reduce__(self) -> tuple:
        rows = list(self)
        if not rows or not all(isinstance(t, torch.Tensor) for t in rows) or len({t.dtype for t in rows}) > 1:
            return (Ragged, (rows,))
        lengths = [t.numel() for t in rows]
        return (_unflatten, (torch.cat([t.detach().reshape(-1).cpu() for t in rows]), lengths))


def _unflatten(flat: torch.Tensor, lengths: list[int]) -> Ragged:
    return Ragged(torch.split(flat, lengths))


def ragged(rows: list | None) -> list | None:
    """`rows` as a `Ragged` when they are tensors (unchanged otherwise)."""
    if rows and all(isinstance(t, torch.Tensor) for t in rows):
        return Ragged(rows)
    return rows


def pad_ragged(
    rows: list[list[float]] | list[torch.Tensor], length: int, dtype=torch.float32
) -> torch.Tensor:
    """Right-pad ragged rows with zeros into a [len(rows), length] tensor (rows longer than `length` are
    cut). One tensor from all rows and one masked write, not a tensor per row."""
    lens = [min(len(row), length) for row in rows]
    out = torch.zeros(len(rows), length, dtype=dtype)
    if not rows or not sum(lens):
        return out
    if all(isinstance(row, torch.Tensor) for row in rows):
        flat = torch.cat([row.reshape(-1)[:n] for row, n in zip(rows, lens, strict=True)]).to(dtype)
    else:
        flat = flat_tensor(rows, dtype, lens)
    out[torch.arange(length)[None, :] < torch.tensor(lens)[:, None]] = flat  # row-major: rows in order
    return out


def flat_tensor(rows: Sequence[Sequence], dtype: torch.dtype, lens: list[int] | None = None) -> torch.Tensor:
    """The rows' values one after another as a 1-D tensor (the first `lens[i]` of row i when given).

    Per-token columns arrive as Python lists (a 2k-token step holds about half a million values a
    column): numpy's `fromiter` over the chained rows reads them in C, where a list comprehension fed to
    `torch.tensor` runs a Python loop, with the same values (`benchmarks/trainer_inputs.py` has the
    figures). Rows of elements numpy cannot read (0-d tensors, say) take the comprehension."""
    if lens is None:
        parts: Sequence = rows
    else:
        parts = [row if len(row) == n else islice(row, n) for row, n in zip(rows, lens, strict=True)]
    count = sum(len(row) for row in rows) if lens is None else sum(lens)
    np_dtype = _NUMPY.get(dtype)
    if np_dtype is not None:
        try:
            return torch.from_numpy(np.fromiter(chain.from_iterable(parts), dtype=np_dtype, count=count))
        except (TypeError, ValueError):
            parts = rows if lens is None else [list(row)[:n] for row, n in zip(rows, lens, strict=True)]
    return torch.tensor([x for row in parts for x in row], dtype=dtype)


_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64, torch.int32: np.int32}
_NUMPY[torch.bool] = np.bool_


def pack_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Split sample indices into as few micro-batches as fit `max_tokens` (padded size: count x longest),
    as even as that count allows.

    Samples are sorted by length first, so each micro-batch holds similar lengths and little padding.
    A single sample longer than the budget gets a micro-batch of its own. Filling each micro-batch to
    the budget would leave the rest of the step to the last one, often a sliver: a compiled trainer's
    layers (`trainer.compile_layers`) then meet a much smaller shape than the others, and Inductor's
    size guards recompile them (docs/gpus.md). So the count is the one the budget needs, and the cut
    points are those of the smallest budget that still gives that count.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches = _fill(order, lengths, max_tokens)
    if len(batches) < 2:
        return batches
    # A larger cap never gives more micro-batches (the cost of a run of sorted samples only grows as it
    # extends), so the smallest cap with this count is found by bisection.
    low, high = 1, max(max_tokens, 1)
    while low < high:
        mid = (low + high) // 2
        if len(_fill(order, lengths, mid)) <= len(batches):
            high = mid
        else:
            low = mid + 1
    return _fill(order, lengths, high)


def _fill(order: list[int], lengths: list[int], cap: int) -> list[list[int]]:
    """`order`'s samples, in that order, filled into micro-batches of padded size up to `cap` (a sample
    over it alone)."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and new_longest * (len(current) + 1) > cap:
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches
