"""The KV pool's ceiling when none is given: a share of the GPU's memory, the fixed number on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.model.paged_kv_cache import BLOCK
from relax.backends.inference.embedded.scheduling.kv_budget import (
    CPU_MAX_TOTAL_TOKENS,
    default_max_total_tokens,
    kv_bytes_per_token,
)
from relax.backends.inference.registry import engine_kwargs, workload_tokens
from relax.config.loader import ConfigError, load_config


def test_bytes_per_token_count_keys_and_values_of_every_layer():
    # Qwen2.5-0.5B: 24 layers, 2 KV heads of 64, bf16 -> 12 KiB a token
    assert kv_bytes_per_token(24, 2, 64, torch.bfloat16) == 12288
    assert kv_bytes_per_token(2, 2, 16, torch.float32) == 512


def test_a_gpu_ceiling_is_the_share_of_its_memory(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=140 * gib)
    )
    cuda = torch.device("cuda", 0)
    # a quarter of 140 GiB at 12 KiB a token: 2.99M tokens, where the CPU's fixed 262,144 held 256 rows of
    # ~1k tokens only
    assert default_max_total_tokens(cuda, 12288) == 35 * gib // 12288
    assert default_max_total_tokens(cuda, 12288, 0.5) == 70 * gib // 12288
    assert default_max_total_tokens(torch.device("cpu"), 12288, 0.5) == CPU_MAX_TOTAL_TOKENS


@pytest.mark.parametrize("fraction", [0.0, -0.1, 0.96, 2.0])
def test_a_fraction_outside_its_range_is_refused(fraction):
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        default_max_total_tokens(torch.device("cpu"), 512, fraction)


def test_an_engine_without_a_budget_takes_the_default_and_a_given_one_wins(tiny_model_dir):
    auto = EmbeddedEngine(str(tiny_model_dir), device="cpu", dtype="float32")
    given = EmbeddedEngine(str(tiny_model_dir), device="cpu", dtype="float32", max_total_tokens=4096)
    assert auto.metrics().kv_capacity == CPU_MAX_TOTAL_TOKENS
    assert given.metrics().kv_capacity == 4096


def test_a_preallocated_pool_holds_its_whole_budget_from_the_start(tiny_model_dir):
    e = EmbeddedEngine(
        str(tiny_model_dir), device="cpu", dtype="float32", max_total_tokens=4096, kv_preallocate=True
    )
    assert e.runner.cache.num_blocks == e.runner.cache.max_blocks == 4096 // BLOCK + 1
    lazy = EmbeddedEngine(str(tiny_model_dir), device="cpu", dtype="float32", max_total_tokens=4096)
    assert lazy.runner.cache.num_blocks == 0


BASE = ["model.path=m", "data.train_files=[d]"]  # the least a run config holds


def test_the_run_config_sizes_the_engines_pool_from_its_workload():
    cfg = load_config(None, [*BASE, "rollout.max_new_tokens=2048", "data.max_prompt_len=1024"])
    kw = engine_kwargs(cfg)
    assert kw["workload_tokens"] == 256 * (1024 + 2048)  # every running row at its longest
    assert kw["max_total_tokens"] is None and kw["kv_memory_fraction"] == 0.25
    evals = load_config(None, [*BASE, "eval.sets=[{name: e, files: [d], max_new_tokens: 4096}]"])
    assert workload_tokens(evals) == 256 * (1024 + 4096)
    agent = load_config(None, [*BASE, "rollout.agent.kind=multi_turn", "rollout.agent.max_total_tokens=8192"])
    assert workload_tokens(agent) == 256 * (1024 + 8192)
    given = load_config(None, [*BASE, "rollout.engine_max_total_tokens=100000"])
    assert engine_kwargs(given)["max_total_tokens"] == 100000
    with pytest.raises(ConfigError):
        load_config(None, [*BASE, "rollout.engine_kv_memory_fraction=1.5"])


def test_only_an_engine_beside_a_training_rank_preallocates():
    def planned(mode: str, engine: float, trainer: float) -> bool:
        cfg = load_config(None, [*BASE, f"schedule.mode={mode}"])
        cfg.resources.engine_gpus, cfg.resources.trainer_gpus = engine, trainer  # as plan_gpus fills them
        return engine_kwargs(cfg)["kv_preallocate"]

    assert planned("colocate", 0.5, 0.5)
    assert not planned("colocate", 0.0, 0.0)  # on the CPU
    assert not planned("hybrid", 1.0, 1.0)  # its own GPU: grows as tokens arrive
