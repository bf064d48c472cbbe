"""`trainer.gradient_checkpointing` really recomputes activations, and the update stays the same.

Hugging Face layers checkpoint only in training mode and `from_pretrained` returns eval mode; the FSDP
backend once enabled checkpointing on an eval-mode model, which kept every activation (the 3B VL run ran
out of memory). The probe: a checkpointed decoder layer runs its MLP twice per micro-batch (forward, then
the recompute in backward)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from test_torch_backend import make_batch

from relax.algorithms import AlgorithmConfig
from relax.algorithms.pipeline import make_policy_loss
from relax.backends.training.fsdp import FSDPWorker
from relax.backends.training.torch_backend import TorchTrainer
from relax.backends.training.update import merge_partials
from relax.config import TrainerConfig

LOSS = make_policy_loss(AlgorithmConfig())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _count_layer_calls(model: torch.nn.Module) -> list[int]:
    # A module inside the layer: the recompute calls the layer's `forward`, not its hooks.
    layer = next(m for name, m in model.named_modules() if name.endswith("layers.0.mlp"))
    calls = [0]
    layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _fsdp_step(model_dir, ckpt: bool) -> tuple[int, dict[str, float], dict[str, torch.Tensor]]:
    cfg = TrainerConfig(backend="fsdp", device="cpu", lr=1e-2, threads=1, gradient_checkpointing=ckpt)
    worker = FSDPWorker(str(model_dir), cfg)
    worker.setup("127.0.0.1", _port())
    try:
        assert worker.model.training
        batch = make_batch(n=4)
        batch.old_log_probs = worker.compute_log_probs(batch)
        calls = _count_layer_calls(worker.model)
        metrics = merge_partials([worker.train_minibatches([batch], LOSS)])
        return calls[0], metrics, worker.named_weights()
    finally:
        worker.shutdown()


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="needs its own process group")
def test_fsdp_checkpointing_recomputes_and_keeps_the_update(tiny_model_dir):
    plain_calls, plain, plain_w = _fsdp_step(tiny_model_dir, ckpt=False)
    ckpt_calls, ckpt, ckpt_w = _fsdp_step(tiny_model_dir, ckpt=True)
    assert plain_calls == 1  # one micro-batch: one forward
    assert ckpt_calls == 2  # and its recompute in backward
    assert abs(plain["train/loss"] - ckpt["train/loss"]) < 1e-6
    assert abs(plain["train/grad_norm"] - ckpt["train/grad_norm"]) < 1e-5
    for name, w in plain_w.items():
        torch.testing.assert_close(ckpt_w[name], w, atol=1e-6, rtol=1e-5)


def test_torch_trainer_honours_checkpointing(tiny_model_dir):
    trainer = TorchTrainer(
        str(tiny_model_dir), TrainerConfig(lr=1e-2, threads=1, gradient_checkpointing=True)
    )
    batch = make_batch(n=4)
    batch.old_log_probs = trainer.compute_log_probs(batch)
    calls = _count_layer_calls(trainer.model)
    trainer.train_batch(batch, LOSS)
    assert calls[0] == 2
