"""The prefix cache across requests (`prefix_cache.py`): outputs are the same with it as without, a
request that shares a prefix prefills fewer tokens, a weight update or `/flush_cache` empties it (and
KV of the old weights is never reused), a small KV budget evicts it and still answers every request."""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.model.paged_kv_cache import PagedKVCache
from relax.backends.inference.embedded.scheduling.prefix_cache import BLOCK, PrefixCache

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
SYSTEM = list(range(1, 3 * BLOCK + 5))  # a shared "system prompt" of three blocks and a bit


def _engine(model_dir, *, cache: bool = True, lean: bool = True, **kw) -> EmbeddedEngine:
    e = EmbeddedEngine(str(model_dir), device="cpu", dtype="float32", seed=0, enable_prefix_cache=cache, **kw)
    if not lean:  # the `transformers` forward, which writes the cache through `update`
        e.runner.lean = None
    return e.start()


def _workload(e: EmbeddedEngine) -> list[list[int]]:
    """GRPO-like groups sent as separate requests, a shared system prompt, and a multi-turn session."""
    outs = []
    prompts = [SYSTEM + [100 + i, 7] for i in range(4)]
    for p in prompts:  # one at a time: each finds the ones before in the cache
        outs.append(e.generate(p, GREEDY)[0].output_ids)
    futures = [e.submit(p, {**GREEDY, "n": 2}) for p in prompts]  # together, n = 2
    outs += [r.output_ids for f in futures for r in f.result()]
    seeded = {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}
    outs.append(e.generate(SYSTEM + [9], seeded)[0].output_ids)
    conversation = SYSTEM + [42]
    for turn in range(3):  # each turn: the whole conversation so far, then a new user message
        out = e.generate(conversation, GREEDY)[0].output_ids
        outs.append(out)
        conversation = conversation + out + [50 + turn, 51]
    return outs


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_outputs_with_the_cache_equal_outputs_without(tiny_model_dir, lean):
    results = {}
    for cache in (False, True):
        e = _engine(tiny_model_dir, cache=cache, lean=lean)
        try:
            results[cache] = _workload(e)
            m = e.metrics()
        finally:
            e.shutdown()
        if cache:
            assert m.prefill_tokens_computed < m.prefill_tokens_submitted / 2
            assert m.cache_hit_rate > 0.5
        else:
            assert m.prefill_tokens_computed == m.prefill_tokens_submitted and m.cache_hit_rate == 0
    assert results[True] == results[False]


def test_a_shared_prefix_is_not_prefilled_again(tiny_model_dir):
    e = _engine(tiny_model_dir)
    try:
        first = SYSTEM + [300, 301]
        e.generate(first, GREEDY)
        before = e.scheduler.prefill_computed
        second = SYSTEM + [400, 401, 402]
        e.generate(second, GREEDY)
        cached = (len(SYSTEM) // BLOCK) * BLOCK
        assert e.scheduler.prefill_computed - before == len(second) - cached
        # the same prompt again: every full block before its last token comes from the cache
        before = e.scheduler.prefill_computed
        e.generate(second, GREEDY)
        assert e.scheduler.prefill_computed - before == len(second) - (len(second) - 1) // BLOCK * BLOCK
        s = e.scheduler  # nothing runs: every block in use is the cache's, one reference each
        assert s.cache.used_blocks() * BLOCK == s.prefix.tokens > 0
        assert s.cache.cache_only == s.cache.used_blocks()
        e.pause(mode="retract")  # drops the KV cache: the prefix cache's memory too
        assert s.cache.store is None and s.prefix.tokens == 0
        e.resume()
        assert e.generate(second, GREEDY)[0].output_ids
    finally:
        e.shutdown()


def test_requests_sharing_a_prompt_sent_together_prefill_it_once(tiny_model_dir):
    """A GRPO group sent as 8 separate requests in one burst: the first prefills the prompt, the others
    wait one step and take it from the cache."""
    prompts = [SYSTEM + [200 + i % 2, 201] for i in range(8)]  # two variants of the last tokens
    results = {}
    for cache in (False, True):
        e = _engine(tiny_model_dir, cache=cache)
        try:
            e.pause()  # all queued before the first admission
            futures = [e.submit(p, GREEDY) for p in prompts]
            e.resume()
            results[cache] = [f.result(timeout=60)[0].output_ids for f in futures]
            s = e.scheduler
            if cache:
                cached = len(SYSTEM) // BLOCK * BLOCK
                assert s.prefill_computed == len(prompts[0]) + 7 * (len(prompts[0]) - cached)
        finally:
            e.shutdown()
    assert results[True] == results[False]


def test_requests_sharing_blocks_past_a_cached_prefix_sent_together_prefill_them_once(tiny_model_dir):
    """The in-batch check past the cache: with the system prompt cached, 6 requests that go on alike for
    two more blocks arrive together; the first computes those blocks, the others wait one step and take
    them from the cache (each then computes only its last tokens)."""
    common = SYSTEM + list(range(300, 300 + 2 * BLOCK))  # the system prompt, then two more blocks
    prompts = [common + [200 + i, 201] for i in range(6)]
    results = {}
    for cache in (False, True):
        e = _engine(tiny_model_dir, cache=cache)
        try:
            e.generate(SYSTEM + [9], GREEDY)  # caches the system prompt's full blocks
            s = e.scheduler
            before = s.prefill_computed
            e.pause()  # all queued before the first admission
            futures = [e.submit(p, GREEDY) for p in prompts]
            e.resume()
            results[cache] = [f.result(timeout=60)[0].output_ids for f in futures]
            if cache:
                sys_cached = len(SYSTEM) // BLOCK * BLOCK
                all_cached = len(common) // BLOCK * BLOCK
                first, rest = len(prompts[0]) - sys_cached, len(prompts[0]) - all_cached
                assert s.prefill_computed - before == first + 5 * rest
        finally:
            e.shutdown()
    assert results[True] == results[False]


def _perturbed(tiny_model_dir, out_dir) -> dict[str, torch.Tensor]:
    """New weights in a model folder of their own (and as tensors)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out_dir)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_weight_update_empties_the_cache_and_old_kv_is_never_reused(tiny_model_dir, tmp_path):
    new_dir = tmp_path / "new"
    _perturbed(tiny_model_dir, new_dir)
    prompt = SYSTEM + [77, 78]
    fresh = _engine(new_dir)
    try:
        want = fresh.generate(prompt, GREEDY)[0].output_ids
    finally:
        fresh.shutdown()
    e = _engine(tiny_model_dir)
    try:
        old = e.generate(prompt, GREEDY)[0].output_ids
        assert e.metrics().prefix_cache_tokens > 0
        kv = e.scheduler.cache
        old_blocks = {int(b) for b in kv.cached.nonzero()[0]}
        assert old_blocks
        e.update_weights_from_disk(str(new_dir), weight_version="1")
        assert e.metrics().prefix_cache_tokens == 0
        # the pool keeps no block of the old weights: none cached, none referenced (nothing runs)
        assert not kv.cached.any() and all(kv.refs[b] == 0 for b in old_blocks)
        before = e.scheduler.prefill_computed
        got = e.generate(prompt, GREEDY)[0].output_ids
        assert e.scheduler.prefill_computed - before == len(prompt)  # nothing reused
        assert got == want and got != old
    finally:
        e.shutdown()


def test_a_request_running_across_an_update_is_not_cached(tiny_model_dir, tmp_path):
    new = _perturbed(tiny_model_dir, tmp_path / "new")
    e = _engine(tiny_model_dir)
    try:
        e.step_sleep_s = 0.02
        future = e.submit(SYSTEM + [5], {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})
        deadline = time.monotonic() + 30
        while e.metrics().num_running == 0:  # admitted: its prompt is cached under the old weights
            assert time.monotonic() < deadline
            time.sleep(0.01)
        e.update_weights(new.items(), weight_version="1")  # live, while it decodes
        assert e.metrics().prefix_cache_tokens == 0
        future.result(timeout=60)
        e.step_sleep_s = 0.0
        assert e.metrics().prefix_cache_tokens == 0  # its KV mixes both versions: not inserted
    finally:
        e.shutdown()


def test_flush_cache_empties_it_and_metrics_report_the_hit_rate(engine_server):
    e = engine_server.engine
    e.generate(SYSTEM + [1], GREEDY)
    e.generate(SYSTEM + [2], GREEDY)
    assert e.metrics().prefix_cache_tokens > 0
    text = httpx.get(engine_server.url + "/metrics", timeout=10).text
    rate = [line for line in text.splitlines() if line.startswith("sglang:cache_hit_rate")]
    assert rate and float(rate[0].split()[-1]) > 0
    assert httpx.post(engine_server.url + "/flush_cache", timeout=10).status_code == 200
    assert e.metrics().prefix_cache_tokens == 0
    before = e.scheduler.prefill_computed
    e.generate(SYSTEM + [3], GREEDY)
    assert e.scheduler.prefill_computed - before == len(SYSTEM) + 1


def test_a_small_budget_evicts_the_cache_and_answers_every_request(tiny_model_dir):
    budget = 20 * BLOCK
    kw = {"max_total_tokens": budget, "max_running": 3}
    # three families sharing two blocks each, then a block and a few tokens of their own
    prompts = [[i % 3 + 1] * (2 * BLOCK) + [100 + i] * (BLOCK + i % 5) for i in range(15)]
    results = {}
    for cache in (False, True):
        e = _engine(tiny_model_dir, cache=cache, **kw)
        try:
            held = []
            s, step = e.scheduler, e.scheduler.step

            def counted(s=s, step=step, held=held) -> int:  # after each step: blocks of rows and cache
                n = step()
                held.append(s.reserved)
                return n

            s.step = counted
            futures = [e.submit(p, {**GREEDY, "max_new_tokens": 16}) for p in prompts]
            results[cache] = [f.result(timeout=120)[0].output_ids for f in futures]
            assert max(held) <= budget + BLOCK  # the budget, rounded up to a block
            if cache:
                assert e.scheduler.prefill_computed < e.scheduler.prefill_submitted  # it did serve hits
                assert e.scheduler.prefix.evicted > 0
        finally:
            e.shutdown()
    assert results[True] == results[False]


def test_eviction_takes_least_recent_leaves_and_keeps_parents_of_cached_blocks():
    kv = PagedKVCache(1, 1, 2, torch.float32, torch.device("cpu"), max_context=8 * BLOCK)
    cache = PrefixCache(kv)
    a = list(range(4 * BLOCK))
    b = a[: 2 * BLOCK] + [999] * (2 * BLOCK)  # shares a's first two blocks
    kv.extend(0, len(a))
    assert cache.insert(a, kv.rows[0]) == 4
    kv.assign(1, cache.match(b, 2 * BLOCK))  # b continues a's first two blocks, shared
    assert kv.rows[1] == kv.rows[0][:2] and kv.refs[kv.rows[0][0]] == 3  # two rows and the cache
    kv.extend(1, len(b))
    assert cache.insert(b, kv.rows[1]) == 2
    assert cache.tokens == 6 * BLOCK
    kv.free_row(0)
    kv.free_row(1)
    assert kv.cache_only == 6 and kv.used_blocks() == 6  # only the cache holds them now
    assert len(cache.match(a, len(a) - 1)) == 3  # its last block holds the last token: not matched
    cache.evict_to(5 * BLOCK)  # a's last block, untouched since a's insert, is the least recent leaf
    assert len(cache.match(a, len(a))) == 3 and len(cache.match(b, len(b))) == 4
    assert kv.used_blocks() == 5  # the evicted block went back to the pool
    cache.evict_to(2 * BLOCK)  # leaves go first, the shared parents last
    assert len(cache.match(a, len(a))) == 2 and len(cache.match(b, len(b))) == 2
    kv.assign(2, cache.match(a, len(a)))  # a row holds the two blocks left: they cannot be evicted
    assert cache.evict(10) == 0 and cache.tokens == 2 * BLOCK
    cache.clear()
    assert cache.tokens == 0 and cache.match(a, len(a)) == []
    assert kv.used_blocks() == 2  # the row keeps them
    kv.free_row(2)
    assert kv.used_blocks() == 0 and kv.cache_only == 0


def test_evicting_long_chains_takes_one_heap_step_per_block(monkeypatch):
    """Agent histories are long chains: freeing one must not rescan the cache once per block."""
    import heapq

    from relax.backends.inference.embedded.scheduling import prefix_cache

    n_chains, length = 8, 64  # blocks each
    kv = PagedKVCache(1, 1, 2, torch.float32, torch.device("cpu"), max_context=length * BLOCK,
                      max_tokens=(n_chains + 1) * length * BLOCK)  # fmt: skip
    cache = PrefixCache(kv)
    chains = [[c * 10_000 + t for t in range(length * BLOCK)] for c in range(n_chains)]
    for row, tokens in enumerate(chains):
        kv.extend(row, len(tokens))
        assert cache.insert(tokens, kv.rows[row]) == length
    for row in range(1, n_chains):  # every chain but the first is still held by its row
        cache.match(chains[row], len(chains[row]))
    kv.free_row(0)
    pops, real_pop = [], heapq.heappop
    monkeypatch.setattr(prefix_cache.heapq, "heappop", lambda h: pops.append(1) or real_pop(h))
    assert cache.evict(length) == length  # the first chain, leaf to root
    assert cache.match(chains[0], len(chains[0])) == [] and cache.tokens == (n_chains - 1) * length * BLOCK
    # each block of the chain, and each held leaf looked at once per step at most: not once per block
    assert len(pops) <= length + n_chains * 2, len(pops)


class _CountingDict(dict):
    def __init__(self, *a) -> None:
        super().__init__(*a)
        self.gets = 0

    def get(self, *a):
        self.gets += 1
        return super().get(*a)


def test_insert_finds_a_rows_cached_head_by_block_and_a_duplicate_by_tokens():
    """After a hit the row's leading blocks are the cache's: insert links past them without building a
    token key for each (an agent's history is hundreds of blocks); a row that computed the same tokens in
    blocks of its own adds none of them and leaves the cached copy in place."""
    kv = PagedKVCache(1, 1, 2, torch.float32, torch.device("cpu"), max_context=8 * BLOCK)
    cache = PrefixCache(kv)
    a = list(range(6 * BLOCK))
    kv.extend(0, len(a))
    assert cache.insert(a, kv.rows[0]) == 6
    longer = a + [7] * (2 * BLOCK)
    kv.assign(1, cache.match(longer, len(longer)))  # the next turn: a's six blocks, then two of its own
    kv.extend(1, len(longer))
    cache.blocks = _CountingDict(cache.blocks)
    assert cache.insert(longer, kv.rows[1]) == 2
    assert cache.blocks.gets == 1  # past the six found by block: one token lookup, for the first new block
    assert cache.match(longer, len(longer)) == kv.rows[1]
    kv.extend(2, len(a))  # the same tokens as row 0, computed again in other blocks
    assert cache.insert(a, kv.rows[2]) == 0
    assert cache.tokens == 8 * BLOCK and cache.match(a, len(a)) == kv.rows[0]
    cache.clear()
    assert cache.insert(a, kv.rows[0]) == 6  # after a clear nothing is found by block
    assert cache.match(a, len(a)) == kv.rows[0]


def test_a_kept_lookup_follows_inserts_and_evictions_without_walking_the_history_again():
    """A waiting prompt's chain is kept per sequence (`memo`): asked again with nothing inserted it costs
    no lookup, after an insert one lookup past its end (or as many as new blocks match), after an eviction
    of its leaf it is the chain's cached head; each answer equals a fresh walk's."""
    kv = PagedKVCache(1, 1, 2, torch.float32, torch.device("cpu"), max_context=8 * BLOCK)
    cache = PrefixCache(kv)
    cache.blocks = _CountingDict()
    a = list(range(6 * BLOCK))
    other = [9_000 + t for t in range(2 * BLOCK)]
    asker = object()

    def peek(limit: int) -> int:
        n = cache.peek(a, limit, memo=asker)
        gets = cache.blocks.gets
        assert n == cache.peek(a, limit)  # a fresh walk agrees
        cache.blocks.gets = gets
        return n

    kv.extend(0, 4 * BLOCK)
    cache.insert(a[: 4 * BLOCK], kv.rows[0])
    cache.blocks.gets = 0
    assert peek(len(a)) == 4 and cache.blocks.gets == 5  # the first walk: four found, the fifth not
    cache.blocks.gets = 0
    assert peek(len(a)) == 4 and cache.blocks.gets == 0  # kept: nothing was inserted since
    kv.extend(1, len(other))
    cache.insert(other, kv.rows[1])  # blocks of another prompt
    cache.blocks.gets = 0
    assert peek(len(a)) == 4 and cache.blocks.gets == 1  # one lookup past the kept end
    kv.assign(2, cache.match(a, 4 * BLOCK))  # another row computes a in full
    kv.extend(2, len(a))
    cache.insert(a, kv.rows[2])
    cache.blocks.gets = 0
    assert peek(len(a)) == 6 and cache.blocks.gets == 2  # the two new blocks only
    assert peek(len(a) - 1) == 5  # another limit: walked again
    assert peek(len(a)) == 6
    for row in (0, 1, 2):
        kv.free_row(row)
    cache.match(other, len(other))  # a's chain is now the least recently used
    cache.evict(1)  # a's leaf
    assert peek(len(a)) == 5
    assert len(cache.match(a, len(a), memo=asker)) == 5 and asker not in cache._peeks  # placed: let go
    cache.clear()
    assert peek(len(a)) == 0
