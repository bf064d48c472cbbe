"""The slot KV cache: growing keeps the contents, `copy` and `move` carry every layer's keys and values
for the columns asked and nothing else, and the per-layer buffers stay views of one store."""

from __future__ import annotations

import torch

from relax.backends.inference.embedded.kv_cache import SlotKVCache


def _filled(layers: int = 3, slots: int = 6, length: int = 10) -> SlotKVCache:
    cache = SlotKVCache(layers, 2, 4, torch.float32, torch.device("cpu"))
    cache.reserve(slots, length, slots)
    cache.store.copy_(torch.randn(cache.store.shape))
    return cache


def test_buffers_are_views_of_one_store_and_growth_keeps_them():
    cache = _filled()
    assert all(k.data_ptr() == cache.store[0, i].data_ptr() for i, k in enumerate(cache.keys))
    before, generation = cache.store.clone(), cache.generation
    cache.reserve(cache.slots + 1, cache.capacity + 1, 64)
    assert cache.generation == generation + 1
    S, C = before.shape[2], before.shape[4]
    assert torch.equal(cache.store[:, :, :S, :, :C], before)
    assert cache.values[2].data_ptr() == cache.store[1, 2].data_ptr()


def test_move_carries_every_layer_for_the_columns_asked():
    cache = _filled()
    before = cache.store.clone()
    cache.move([4, 5], [0, 2], length=7)
    want = before.clone()
    want[:, :, [0, 2], :, :7] = before[:, :, [4, 5], :, :7]
    assert torch.equal(cache.store, want)
    for layer in range(3):  # as the model reads them
        assert torch.equal(cache.keys[layer][0, :, :7], before[0, layer, 4, :, :7])
        assert torch.equal(cache.values[layer][2, :, :7], before[1, layer, 5, :, :7])


def test_copy_fans_one_slot_out():
    cache = _filled()
    before = cache.store.clone()
    cache.copy(1, [3, 4, 5], length=5)
    want = before.clone()
    want[:, :, 3:6, :, :5] = before[:, :, 1:2, :, :5]
    assert torch.equal(cache.store, want)
