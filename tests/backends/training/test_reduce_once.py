"""A one-rank FSDP trainer reduces its gradients once a step (`Trainable.reduce_once`), not once per
micro-batch, and the update is the same as with a reduction per micro-batch."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group
from test_torch_backend import make_batch

from relax.algorithms import AlgorithmConfig
from relax.algorithms.pipeline import make_policy_loss
from relax.backends.training.fsdp import FSDPWorker
from relax.backends.training.update import merge_partials
from relax.config import TrainerConfig

LOSS = make_policy_loss(AlgorithmConfig(), tensor_metrics=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(model_dir, monkeypatch, reduce_once: bool):
    """(reductions, micro-batches, metrics, weights) of one optimizer step on a fresh one-rank worker."""
    cfg = TrainerConfig(backend="fsdp", device="cpu", lr=1e-2, threads=1, max_tokens_per_micro_batch=16)
    worker = FSDPWorker(str(model_dir), cfg)
    worker.setup("127.0.0.1", _port())
    try:
        assert worker.policy.reduce_once  # the default on one rank
        worker.policy.reduce_once = reduce_once
        batch = make_batch(n=6)
        batch.old_log_probs = worker.compute_log_probs(batch)
        calls = [0]
        real = fsdp_group.foreach_reduce

        def counted(*args, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(fsdp_group, "foreach_reduce", counted)
        micro = len(worker._plan(batch.seq_lens()))
        metrics = merge_partials([worker.train_minibatches([batch], LOSS)])
        monkeypatch.setattr(fsdp_group, "foreach_reduce", real)
        return calls[0], micro, metrics, worker.named_weights()
    finally:
        worker.shutdown()


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="needs its own process group")
def test_one_rank_reduces_once_a_step_with_the_same_update(tiny_model_dir, monkeypatch):
    once, micro, m_once, w_once = _step(tiny_model_dir, monkeypatch, reduce_once=True)
    each, _, m_each, w_each = _step(tiny_model_dir, monkeypatch, reduce_once=False)
    assert micro >= 3
    assert once > 0 and each == micro * once  # every FSDP group reduces at each micro-batch, or once
    assert m_once["train/loss"] == pytest.approx(m_each["train/loss"], abs=1e-7)
    assert m_once["train/grad_norm"] == pytest.approx(m_each["train/grad_norm"], rel=1e-6)
    for name, w in w_each.items():
        torch.testing.assert_close(w_once[name], w, atol=1e-7, rtol=1e-6)


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="needs its own process group")
def test_the_memory_plan_keeps_it_only_where_the_micro_batches_keep_their_size(tiny_model_dir, monkeypatch):
    import relax.backends.training.fsdp as fsdp
    from relax.backends.training.memory import MemoryPlan

    worker = FSDPWorker(str(tiny_model_dir), TrainerConfig(backend="fsdp", device="cpu", lr=1e-2, threads=1))
    worker.setup("127.0.0.1", _port())
    try:
        # a GPU-like plan: the budget is what the room left after `pending` holds, capped at 4096
        for room, keeps in [(10**12, True), (4 * 10**6, False)]:
            worker.policy.tokens, worker.policy.reduce_once = None, True
            plans = []

            def plan(cfg, device, model, pending, compute=2, room=room, plans=plans):
                plans.append(MemoryPlan(int(min(4096, (room - pending) // 1000)), False, "test"))
                return plans[-1]

            monkeypatch.setattr(fsdp, "plan_memory", plan)
            budget = worker._budget()
            assert worker.policy.reduce_once is keeps
            with_unsharded, per_micro_batch = plans
            assert (with_unsharded.tokens == per_micro_batch.tokens) is keeps
            assert budget == per_micro_batch.tokens  # never smaller micro-batches for it
    finally:
        worker.shutdown()
