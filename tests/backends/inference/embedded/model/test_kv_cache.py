"""The paged KV cache (`paged_kv_cache.py`): rows hold blocks for the tokens they hold, a row move hands
its blocks over without copying KV, samples share full blocks by reference and copy the partial last one,
a full pool preempts instead of failing (the output identical, greedy and seeded), and block tables with
shared prefix blocks give the same tokens as no cache."""

from __future__ import annotations

import pytest
import torch

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.http.metrics import render_metrics
from relax.backends.inference.embedded.model.paged_kv_cache import BLOCK, PagedKVCache
from relax.rollout.engine_stats import parse_engine_metrics


def _cache(max_tokens: int = 64 * BLOCK) -> PagedKVCache:
    return PagedKVCache(
        3, 2, 4, torch.float32, torch.device("cpu"), max_context=16 * BLOCK, max_tokens=max_tokens
    )


def test_rows_hold_the_blocks_of_their_tokens_and_block_zero_is_never_handed_out():
    kv = _cache()
    assert kv.extend(0, 1) and len(kv.rows[0]) == 1
    assert kv.extend(0, BLOCK) and len(kv.rows[0]) == 1  # still one block
    assert kv.extend(0, BLOCK + 1) and len(kv.rows[0]) == 2
    assert kv.extend(1, 3 * BLOCK) and len(kv.rows[1]) == 3
    assert 0 not in kv.rows[0] + kv.rows[1] and kv.used_blocks() == 5
    kv.sync()
    assert kv.table[1, :3].tolist() == kv.rows[1] and kv.table[1, 3:].eq(0).all()
    kv.free_row(1)
    kv.sync()
    assert kv.used_blocks() == 2 and kv.table[1].eq(0).all()  # cleared entries reach the device table


def test_move_hands_blocks_over_and_copy_shares_full_blocks():
    kv = _cache()
    kv.extend(4, 2 * BLOCK + 5)
    kv.store.copy_(torch.randn(kv.store.shape))
    before = kv.store.clone()
    blocks = list(kv.rows[4])
    kv.move([4], [0])
    assert kv.rows[0] == blocks and kv.rows[4] == [] and torch.equal(kv.store, before)  # no KV copied
    kv.copy(0, [1, 2], 2 * BLOCK + 5)
    for r in (1, 2):  # full blocks shared, the partial last one copied
        assert kv.rows[r][:2] == blocks[:2] and kv.rows[r][2] != blocks[2]
        assert torch.equal(kv.store[:, :, kv.rows[r][2]], before[:, :, blocks[2]])
    assert kv.refs[blocks[0]] == 3 and kv.refs[blocks[2]] == 1
    for r in (0, 1, 2):
        kv.free_row(r)
    assert kv.used_blocks() == 0


def test_the_budget_bounds_the_pool_and_a_forced_row_grows_past_it():
    kv = _cache(max_tokens=4 * BLOCK)
    assert kv.extend(0, 4 * BLOCK)
    assert not kv.extend(1, 1) and kv.rows[1] == []  # nothing taken when it cannot
    assert kv.extend(1, 1, force=True) and kv.used_blocks() == 5


def test_prefill_and_decode_write_blocks_and_attend_as_a_contiguous_cache():
    """The torch path (CPU): what `update` returns equals the keys written, column by column."""
    kv = _cache()
    kv.extend(0, 40)
    kv.extend(1, 20)
    k = torch.randn(2, 2, 20, 4)
    rows = torch.tensor([1, 0])
    kv.for_prefill(rows)
    kv.update(k, k + 1, 0)
    pos = torch.tensor([20, 19])  # row 1 writes column 20 (a new block for it), row 0 column 19
    kv.extend(1, 21)
    new = torch.randn(2, 2, 1, 4)
    kv.for_decode(pos, 21, rows)
    keys, values = kv.update(new, new, 0)
    assert keys.shape == (2, 2, 21, 4)
    assert torch.equal(keys[0, :, :20], k[0]) and torch.equal(keys[0, :, 20], new[0, :, 0])
    assert torch.equal(keys[1, :, :19], k[1, :, :19]) and torch.equal(keys[1, :, 19], new[1, :, 0])
    assert torch.equal(values[0, :, :20], k[0] + 1)


def test_the_cpu_decode_mirror_follows_moves_fan_out_and_reused_rows():
    """On the CPU a decode step attends over a contiguous mirror of the rows' KV: after rows move, fan out
    to samples, are freed and reused, every step still attends over exactly the pool's columns."""
    kv = _cache()
    torch.manual_seed(0)
    lens = [BLOCK + 3, 5]  # tokens each row holds after its prefill
    for r, n in enumerate(lens):
        kv.extend(r, n)
    kv.for_prefill(torch.tensor([0, 1]))
    kv.update(torch.randn(2, 2, max(lens), 4), torch.randn(2, 2, max(lens), 4), 0)

    def step() -> None:
        B = len(lens)
        for r in range(B):
            kv.extend(r, lens[r] + 1)
        pos = torch.tensor(lens)
        length = max(lens) + 1
        kv.for_decode(pos, length)
        new = torch.randn(B, 2, 1, 4)
        keys, values = kv.update(new, -new, 0)
        want = kv._gather(kv.keys[0], torch.arange(B), length)
        for r in range(B):  # columns past a row's own are other rows' padding: not compared
            assert torch.equal(keys[r, :, : lens[r] + 1], want[r, :, : lens[r] + 1])
            assert torch.equal(values[r, :, lens[r]], -new[r, :, 0])
        for r in range(B):
            lens[r] += 1

    for _ in range(3):
        step()
    kv.move([1], [2])  # row 1 leaves, then row 0 moves into its place and row 2 back to 0
    kv.move([0, 2], [1, 0])
    lens.reverse()
    step()
    kv.copy(1, [2, 3], lens[1])  # row 1 fans out to two samples
    lens += [lens[1], lens[1]]
    step()
    kv.free_row(0)  # a fresh prompt takes row 0
    kv.extend(0, 7)
    kv.for_prefill(torch.tensor([0]))
    kv.update(torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4), 0)
    lens[0] = 7
    for _ in range(BLOCK + 1):  # across a block boundary
        step()
    kv.release()
    assert kv.store is None


GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}


def _outputs(model_dir, overlap: bool, device: str = "cpu", **kw) -> tuple[list[list[int]], int]:
    e = EmbeddedEngine(str(model_dir), device=device, dtype="float32", seed=0, overlap=overlap, **kw).start()
    try:
        e.pause()  # all admitted together, so the pool runs out while they decode
        prompts = [[i + 1] * (BLOCK + 3 * i) for i in range(6)]
        # CUDA samples a batch of sampled rows with one fused kernel (a seed drawn per row), a batch with a
        # greedy row by a draw over the vocabulary: a seeded row's stream there depends on whether greedy
        # rows share its batch, so on CUDA every row is sampled
        mixed = device == "cpu"
        futures = [e.submit(p, GREEDY if i % 2 and mixed else SEEDED) for i, p in enumerate(prompts)]
        futures.append(e.submit([7, 8, 9], {**SEEDED, "n": 3}))
        e.resume()
        outs = [r.output_ids for f in futures for r in f.result(timeout=300)]
        # the count the scheduler keeps is the one /metrics reports (and the run's metrics read)
        exposed = parse_engine_metrics(render_metrics(e)[0].decode())["preempted"]
        assert exposed == e.scheduler.preempted == e.metrics().preempted_total
        return outs, e.scheduler.preempted
    finally:
        e.shutdown()


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))],
)
def test_a_full_kv_cache_preempts_and_the_output_is_identical(tiny_model_dir, device):
    """Nine sequences of up to 80 tokens in a pool of 12 blocks (192 tokens): rows are preempted and
    prefilled again; every request is answered, each with the tokens a roomy engine gives."""
    want, none = _outputs(tiny_model_dir, overlap=False, device=device, max_total_tokens=1 << 14)
    assert none == 0
    for overlap in (False, True):
        got, preempted = _outputs(tiny_model_dir, overlap, device, max_total_tokens=12 * BLOCK)
        assert preempted > 0
        assert got == want


def test_a_device_out_of_memory_for_the_pool_preempts_instead_of_failing(tiny_model_dir, monkeypatch):
    """The budget is roomy but the device holds no pool past 40 blocks (a larger allocation raises the
    out-of-memory error a GPU raises): the first pool of 64 is refused, one of 32 taken and made the
    budget, rows past it are preempted, and every request gets the tokens an engine with room gives."""
    want, _ = _outputs(tiny_model_dir, overlap=False, max_total_tokens=1 << 14)
    new_store = PagedKVCache._new_store
    asked: list[int] = []

    def small_device(self, blocks):
        asked.append(blocks)
        if blocks > 40:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return new_store(self, blocks)

    monkeypatch.setattr(PagedKVCache, "_new_store", small_device)
    got, preempted = _outputs(tiny_model_dir, overlap=False, max_total_tokens=1 << 14)
    assert asked[:2] == [64, 32]  # refused, then half of it taken
    assert preempted > 0
    assert got == want
