"""`flat_tensor` and `pad_ragged`: per-token Python lists into tensors through numpy's `fromiter`, with
the values, dtypes and truncation of the comprehension the Actor and its rank used before."""

from __future__ import annotations

import random

import pytest
import torch

from relax.data.batch import flat_tensor, pad_ragged


def comprehension(rows, dtype, lens=None):
    lens = lens or [len(r) for r in rows]
    return torch.tensor([x for row, n in zip(rows, lens, strict=True) for x in list(row)[:n]], dtype=dtype)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.bfloat16]
)
def test_the_values_are_the_comprehensions(dtype):
    rng = random.Random(0)
    floats = [[rng.uniform(-30, 30) for _ in range(rng.randrange(0, 50))] for _ in range(20)]
    ints = [[rng.randrange(151_936) for _ in range(len(r))] for r in floats]
    masks = [[float(rng.random() < 0.8) for _ in range(len(r))] for r in floats]
    rows = {torch.bool: masks, torch.int64: ints, torch.int32: ints}.get(dtype, floats)
    got = flat_tensor(rows, dtype)
    assert got.dtype == dtype and torch.equal(got, comprehension(rows, dtype))  # float32: the same rounding
    lens = [max(0, len(r) - 3) for r in rows]
    assert torch.equal(flat_tensor(rows, dtype, lens), comprehension(rows, dtype, lens))


def test_rows_numpy_cannot_read_and_empty_rows():
    rows = [[torch.tensor(1.5), torch.tensor(2.0)], [torch.tensor(-3.0)]]
    assert flat_tensor(rows, torch.float32).tolist() == [1.5, 2.0, -3.0]
    assert flat_tensor([[], []], torch.float32).numel() == 0
    assert flat_tensor([(1, 2), range(3, 5)], torch.long).tolist() == [1, 2, 3, 4]  # any sequence


def test_pad_ragged_pads_and_cuts_lists_and_tensors_alike():
    rows = [[1.0, 2.0, 3.0], [4.0], []]
    want = [[1.0, 2.0], [4.0, 0.0], [0.0, 0.0]]
    assert pad_ragged(rows, 2).tolist() == want
    assert pad_ragged([torch.tensor(r) for r in rows], 2).tolist() == want
    assert pad_ragged([[1, 2], [3]], 3, torch.long).tolist() == [[1, 2, 0], [3, 0, 0]]
