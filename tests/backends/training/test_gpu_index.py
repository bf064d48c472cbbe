"""`trainer.ranks_see_all_gpus`: a rank that sees every GPU picks the one Ray assigned, by its position
among the visible devices; without the setting (Ray narrowed the devices) it takes device 0."""

from __future__ import annotations

import pytest

from relax.backends.training import fsdp


@pytest.fixture
def assigned(monkeypatch):
    import ray

    def set_ids(ids, visible=None, noset="1"):
        monkeypatch.setattr(ray, "is_initialized", lambda: True)
        monkeypatch.setattr(ray, "get_gpu_ids", lambda: ids)
        monkeypatch.setenv(fsdp.NOSET_CUDA_ENV, noset)
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        return fsdp.assigned_gpu_index()

    return set_ids


def test_all_gpus_visible_takes_ray_s_gpu(assigned):
    assert assigned([1]) == 1
    assert assigned(["3"], visible="2,3") == 1  # the node itself exposes GPUs 2 and 3: index 1


def test_narrowed_devices_take_device_zero(assigned):
    assert assigned([1], noset="0") == 0
    assert assigned([]) == 0
