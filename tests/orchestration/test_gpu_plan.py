"""The GPU plan (`orchestration/gpus.py`): colocate puts one training rank on each GPU beside an engine;
more ranks than GPUs train on the CPU under `trainer.device=auto` and stop the run under `cuda`."""

from __future__ import annotations

import pytest

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
