"""The GPU plan (`orchestration/gpus.py`): colocate puts one training rank on each GPU beside an engine;
more ranks than GPUs train on the CPU under `trainer.device=auto` and stop the run under `cuda`."""

from __future__ import annotations

import pytest

from relax.backends.inference.registry import UnknownEngineError
from relax.config import load_config
from relax.orchestration.gpus import plan_gpus


def _cfg(*overrides: str):
    return load_config("tests/toy_arith.yaml", ["model.path=unused", "trainer.backend=fsdp", *overrides])


def test_colocate_shares_each_gpu_between_a_rank_and_an_engine():
    cfg = plan_gpus(_cfg("trainer.num_ranks=2"), gpus=2)
    assert (cfg.resources.engine_gpus, cfg.resources.trainer_gpus) == (0.5, 0.5)


def test_more_ranks_than_gpus_train_on_the_cpu_under_auto():
    cfg = plan_gpus(_cfg("trainer.num_ranks=2"), gpus=1)
    assert (cfg.resources.engine_gpus, cfg.resources.trainer_gpus) == (0.5, 0.0)
    assert cfg.trainer.weight_sync_backend == "gloo"  # CPU ranks send through host memory


def test_more_ranks_than_gpus_under_cuda_stop_the_run_naming_the_keys():
    with pytest.raises(ValueError, match="trainer.num_ranks=2 needs 2 GPUs.*trainer.device=cpu"):
        plan_gpus(_cfg("trainer.num_ranks=2", "trainer.device=cuda"), gpus=1)


def test_the_engine_backend_sets_the_engines_share_and_the_weight_defaults():
    """The plan asks the engine registry: embedded engines take packed buckets and CUDA IPC, so a
    colocated rank keeps NCCL; SGLang engines take tensors one by one and no IPC, so the same layout falls
    back to gloo."""
    emb = plan_gpus(_cfg("schedule.mode=colocate"), gpus=1)
    sgl = plan_gpus(_cfg("schedule.mode=colocate", "rollout.engine=sglang"), gpus=1)
    assert (emb.resources.engine_gpus, sgl.resources.engine_gpus) == (0.5, 0.5)
    assert (emb.trainer.weight_sync_flatten, emb.trainer.weight_sync_backend) == (True, "nccl")
    assert (sgl.trainer.weight_sync_flatten, sgl.trainer.weight_sync_backend) == (False, "gloo")
    split = plan_gpus(_cfg("schedule.mode=hybrid", "rollout.engine=sglang"), gpus=2)
    assert (split.resources.engine_gpus, split.trainer.weight_sync_backend) == (1.0, "nccl")


def test_only_engines_in_the_cluster_count_against_its_gpus():
    four = ("schedule.mode=hybrid", "rollout.num_engines=4")
    with pytest.raises(ValueError, match="4 engine.*needs 5 GPUs; the cluster has 2"):
        plan_gpus(_cfg(*four), gpus=2)
    with pytest.raises(ValueError, match="needs 5 GPUs"):
        plan_gpus(_cfg(*four, "rollout.engine=sglang"), gpus=2)
    external = ("rollout.engine=external", "rollout.engine_urls=[http://10.0.0.9:30000]")
    assert plan_gpus(_cfg(*four, *external), gpus=2).resources.trainer_gpus == 1.0  # engines run elsewhere


def test_an_unknown_engine_names_the_known_ones():
    with pytest.raises(
        UnknownEngineError,
        match="'vllm' is no engine backend; the known ones are: embedded, external, sglang",
    ):
        plan_gpus(_cfg("rollout.engine=vllm"), gpus=1)
