"""A training step's host reads: its sums (`StepSums`) and forward-only rows (`RowsToHost`) are read
once at the step's end, and read the same as a read per micro-batch did."""

from __future__ import annotations

import pytest
import torch

from relax.backends.training import forward as fw
from relax.backends.training.update import StepSums


def test_sums_of_device_tensors_and_floats_read_as_the_host_sums():
    parts = [(0.5, 3.0, {"a": 0.25, "b": -1.0}), (-0.125, 5.0, {"a": 0.75, "b": 2.0}), (1.0, 0.0, {"a": 9.0})]
    on_host, on_device = StepSums(), StepSums()
    for loss, w, m in parts:
        on_host.add(loss, w, m)
        on_device.add(torch.tensor(loss), torch.tensor(w), {k: torch.tensor(v) for k, v in m.items()})
    loss, weight, weighted = on_device.values()
    assert (loss, weight) == (1.375, 8.0)
    assert weighted == {"a": 0.25 * 3 + 0.75 * 5 + 0.0, "b": -3.0 + 10.0}
    assert on_host.values() == (loss, weight, weighted)
    assert all(type(v) is float for v in (loss, weight, *weighted.values()))


def test_an_empty_step_reads_as_zeros():
    assert StepSums().values() == (0.0, 0.0, {})


def _micro_batch(index: list[int], lens: list[int]) -> fw.MicroBatch:
    B, T = len(lens), max(lens)
    z = torch.zeros(B, T, dtype=torch.long)
    return fw.MicroBatch(z, z, z, torch.tensor(lens), T, index)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])  # fmt: skip
def test_rows_to_host_cut_each_micro_batch_by_its_response_lengths(device):
    pending = fw.RowsToHost()
    a = torch.arange(12.0, device=device).reshape(3, 4)
    b = -torch.arange(6.0, device=device).reshape(2, 3)
    pending.add(a, _micro_batch([4, 0, 2], [4, 1, 2]))
    pending.add(torch.ones(1, 1, device=device), _micro_batch([], [1]))  # a dummy: no rows
    pending.add(b, _micro_batch([1, 3], [3, 2]))
    a = a.cpu().tolist()  # read after the adds: the copies must not depend on the sources outliving them
    rows = {i: r.tolist() for i, r in pending.rows().items()}
    assert rows == {4: a[0], 0: a[1][:1], 2: a[2][:2], 1: [0.0, -1.0, -2.0], 3: [-3.0, -4.0]}
    assert all(r.device.type == "cpu" for r in pending.rows().values())
    assert fw.split_rows(b, _micro_batch([1, 3], [3, 2]))[3].tolist() == [-3.0, -4.0]
