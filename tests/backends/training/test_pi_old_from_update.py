"""pi_old from the update's own forward: the same update as a separate forward pass, and the pass's
log-probs handed back; refused where the weights move before a later mini-batch; and the Actor uses it
only where a separate pass would compute the same values."""

from __future__ import annotations

import pytest
import torch
from test_fsdp_group import LOSS, fsdp_cfg
from test_torch_backend import make_batch

from relax.backends.training.rank_group import TrainerGroup
from relax.backends.training.torch_backend import TorchTrainer
from relax.config import TrainerConfig, load_config
from relax.roles.actor import pi_old_from_update


def _exp_avg(trainer) -> dict[str, torch.Tensor]:
    return {n: trainer.optimizer.state[p]["exp_avg"].clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("budget", [10_000, 12])
def test_one_rank_update_matches_a_separate_forward(tiny_model_dir, budget):
    cfg = TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=budget)
    sep, fused = TorchTrainer(str(tiny_model_dir), cfg), TorchTrainer(str(tiny_model_dir), cfg)
    b_sep, b_fused = make_batch(n=7), make_batch(n=7)
    b_sep.old_log_probs = sep.compute_log_probs(b_sep)
    want = sep.train_batch(b_sep, LOSS)
    assert b_fused.old_log_probs is None
    got = fused.train_batch(b_fused, LOSS, pi_old_from_forward=True)
    for a, b in zip(b_fused.old_log_probs, b_sep.old_log_probs, strict=True):  # handed back per row
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert got["train/loss"] == pytest.approx(want["train/loss"], abs=1e-6)
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    assert got["staleness/first_mb_ratio_dev"] == 0.0  # pi_old is the forward itself
    for name, g in _exp_avg(sep).items():
        torch.testing.assert_close(_exp_avg(fused)[name], g, atol=1e-7, rtol=1e-4)


def test_two_ranks_hand_back_every_row(tiny_model_dir, ray_cluster):
    group = TrainerGroup(str(tiny_model_dir), fsdp_cfg(num_ranks=2, max_tokens_per_micro_batch=12))
    try:
        batch = make_batch(n=7)
        want = group.compute_log_probs(batch)
        metrics = group.train_batch(batch, LOSS, pi_old_from_forward=True)
        assert group.step == 1 and metrics["staleness/first_mb_ratio_dev"] == 0.0
        for a, b in zip(batch.old_log_probs, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    finally:
        group.shutdown()


def test_refused_with_several_mini_batches(tiny_model_dir):
    trainer = TorchTrainer(str(tiny_model_dir), TrainerConfig(lr=1e-2, num_mini_batches=2))
    with pytest.raises(ValueError, match="one optimizer step per batch.*num_mini_batches"):
        trainer.train_batch(make_batch(), LOSS, pi_old_from_forward=True)
    with pytest.raises(ValueError, match="old_log_probs"):
        trainer.train_batch(make_batch(), LOSS)  # and without it, pi_old must be there


@pytest.mark.parametrize(
    ("overrides", "want"),
    [
        ([], True),  # colocate, GRPO, pi_old recomputed, one mini-batch
        (["schedule.mode=hybrid", "schedule.max_staleness=1"], True),
        (["trainer.num_mini_batches=2"], False),  # later mini-batches run on moved weights
        (["algorithm.old_log_probs=rollout"], False),  # pi_old is the engine's
        (["algorithm.reward_kl_coef=0.01"], False),  # advantages read pi_old before the update
        (["trainer.pi_old_from_update=false"], False),
        (["schedule.mode=fully_async", "schedule.max_staleness=1"], False),  # ActorFwd computes it
    ],
)
def test_the_actor_takes_it_only_where_a_pass_would_give_the_same(overrides, want):
    cfg = load_config("tests/toy_arith.yaml", ["model.path=unused", *overrides])
    assert pi_old_from_update(cfg) is want
