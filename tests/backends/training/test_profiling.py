"""A rank's per-step figures: forward-only seconds, the micro-batch plan in the step's metrics, and with
`RELAX_PROFILE_STEPS` a profile of the whole step (its forward passes and the update) on disk."""

from __future__ import annotations

import gzip
import json
import socket

import pytest
import torch.distributed as dist
from test_torch_backend import make_batch

from relax.algorithms import AlgorithmConfig
from relax.algorithms.pipeline import make_policy_loss
from relax.backends.training.fsdp import FSDPWorker
from relax.backends.training.update import merge_partials
from relax.config import TrainerConfig


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="needs its own process group")
def test_a_profiled_step_covers_its_forward_and_update(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_PROFILE_STEPS", "2")
    monkeypatch.setenv("RELAX_PROFILE_DIR", str(tmp_path))
    cfg = TrainerConfig(backend="fsdp", device="cpu", lr=1e-2, threads=1, max_tokens_per_micro_batch=24)
    worker = FSDPWorker(str(tiny_model_dir), cfg)
    worker.setup("127.0.0.1", _port())
    loss = make_policy_loss(AlgorithmConfig())
    try:
        for step in (1, 2):
            batch = make_batch(n=6, seed=step)
            batch.old_log_probs = worker.compute_log_probs(batch)
            metrics = merge_partials([worker.train_minibatches([batch], loss)])
            assert metrics["perf/rank_forward_s"] > 0 and metrics["perf/rank_update_s"] > 0
            assert metrics["perf/micro_batch_tokens"] == 24 and metrics["perf/activation_checkpointing"] == 0
    finally:
        worker.shutdown()
    assert not (tmp_path / "train_step1_rank0.txt").exists()
    assert "aten::" in (tmp_path / "train_step2_rank0.txt").read_text()
    events = json.loads(gzip.open(tmp_path / "train_step2_rank0.json.gz").read())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any("addmm" in n or "aten::mm" in n for n in names)  # the layers' matrix products
