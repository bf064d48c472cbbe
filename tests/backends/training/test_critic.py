"""PPO's critic, in process and sharded on the FSDP ranks beside the policy.

The value head starts at zero, so before the first update every value is 0 and the step's metrics have
closed forms in the returns R over the trained (masked-in) tokens: value error mean(R^2), value loss
0.5 mean(R^2) (no clipping: V = V_old), value mean and clip fraction 0. The gradient reaches only the
head: dL/dV = V - R = -R times the head weight (zero) is all the backbone gets, and the head bias's
gradient is -mean(R), so after one AdamW step its first moment is (1 - beta1) * -mean(R).
"""

from __future__ import annotations

import pytest
import torch
from test_fsdp_group import fsdp_cfg
from test_torch_backend import make_batch

from relax.algorithms import AlgorithmConfig
from relax.algorithms.pipeline import make_value_loss
from relax.backends.training.critic_backend import TorchCritic
from relax.backends.training.rank_group import TrainerGroup
from relax.config import TrainerConfig
from relax.data.batch import pack_micro_batches

VALUE_LOSS = make_value_loss(AlgorithmConfig(name="ppo"))
BETA1 = 0.9


def critic_batch(n: int = 6, seed: int = 0):
    """A batch with returns 0.5 * (t + 1) * (-1)^b on token t of row b, and the second token of every
    row masked out."""
    b = make_batch(n=n, seed=seed)
    b.returns = [
        torch.tensor([0.5 * (t + 1) * (-1) ** i for t in range(len(r))]) for i, r in enumerate(b.response_ids)
    ]
    b.loss_mask = [[0.0 if t == 1 else 1.0 for t in range(len(r))] for r in b.response_ids]
    return b


def trained_returns(batch) -> torch.Tensor:
    return torch.cat(
        [r[torch.tensor(m) > 0] for r, m in zip(batch.returns, batch.loss_mask, strict=True)]
    )  # R over the masked-in tokens


def _assert_closed_form(metrics: dict[str, float], R: torch.Tensor) -> None:
    r2 = float((R**2).mean())
    assert metrics["critic/value_error"] == pytest.approx(r2, rel=1e-5)
    assert metrics["critic/vf_loss"] == pytest.approx(0.5 * r2, rel=1e-5)
    assert metrics["critic/loss"] == pytest.approx(0.5 * r2, rel=1e-5)  # token_mean, value_loss_coef 1
    assert metrics["critic/value_mean"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["critic/vf_clip_frac"] == 0.0


@pytest.mark.parametrize("budget", [10_000, 12])
def test_critic_metrics_are_token_means_over_micro_batches(tiny_model_dir, budget):
    """One micro-batch or several: the same metrics (they were summed over micro-batches, not averaged)."""
    batch = critic_batch()
    assert (len(pack_micro_batches(batch.seq_lens(), budget)) > 2) == (budget == 12)
    cfg = TrainerConfig(lr=1e-2, max_tokens_per_micro_batch=budget, max_grad_norm=1e9)  # no clipping
    critic = TorchCritic(str(tiny_model_dir), cfg)
    old = critic.compute_values(batch)
    assert [len(v) for v in old] == batch.response_lens() and all(v.abs().max() == 0 for v in old)
    metrics = critic.train_values(batch, old, VALUE_LOSS)
    R = trained_returns(batch)
    _assert_closed_form(metrics, R)
    assert metrics["critic/grad_norm"] > 0 and metrics["critic/lr"] == pytest.approx(1e-2)
    state = critic.optimizer.state
    bias = critic.model.value_head.bias
    torch.testing.assert_close(state[bias]["exp_avg"], torch.tensor([(1 - BETA1) * -float(R.mean())]))
    backbone = [p for n, p in critic.model.named_parameters() if not n.startswith("value_head")]
    assert all(float(state[p]["exp_avg"].abs().max()) == 0.0 for p in backbone)  # no gradient through 0
    assert all(v.abs().max() > 0 for v in critic.compute_values(batch))  # the head moved


def test_critic_metrics_average_over_mini_batches(tiny_model_dir):
    """Two optimizer steps: each step's token means, averaged; the first step barely moves the values
    at lr 1e-12, so both steps keep the closed forms of their own rows (rows k::2)."""
    batch = critic_batch()
    cfg = TrainerConfig(lr=1e-12, num_mini_batches=2, max_tokens_per_micro_batch=12)
    critic = TorchCritic(str(tiny_model_dir), cfg, total_steps=1)
    metrics = critic.train_values(batch, critic.compute_values(batch), VALUE_LOSS)
    per_step = [trained_returns(batch.subset([0, 2, 4])), trained_returns(batch.subset([1, 3, 5]))]
    want = sum(float((R**2).mean()) for R in per_step) / 2
    assert metrics["critic/value_error"] == pytest.approx(want, rel=1e-4)
    assert metrics["critic/loss"] == pytest.approx(0.5 * want, rel=1e-4)


def test_fsdp_critic_is_sharded_like_the_policy_and_matches(tiny_model_dir, ray_cluster, tmp_path):
    """PPO with the FSDP backend: the critic lives on the policy's 2 ranks; its metrics have the closed
    forms, its values after an update are the in-process critic's, and it checkpoints with the policy."""
    batch = critic_batch()
    local = TorchCritic(str(tiny_model_dir), TrainerConfig(lr=1e-2, threads=1, device="cpu"))
    local.train_values(batch, local.compute_values(batch), VALUE_LOSS)
    want = local.compute_values(batch)

    group = TrainerGroup(str(tiny_model_dir), fsdp_cfg(num_ranks=2), with_critic=True)
    try:
        old = group.critic.compute_values(batch)
        assert all(v.abs().max() == 0 for v in old)
        metrics = group.critic.train_values(batch, old, VALUE_LOSS)
        _assert_closed_form(metrics, trained_returns(batch))
        assert group.step == 0  # the critic's update does not advance the policy's weight version
        got = group.critic.compute_values(batch)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        group.save(tmp_path / "ckpt")
        assert (tmp_path / "ckpt" / "critic" / "dcp" / ".metadata").exists()
    finally:
        group.shutdown()


@pytest.mark.slow
def test_ppo_with_fsdp_ranks_trains_the_critic_on_them(
    ray_cluster, shared_engine, tiny_model_dir, arith_file, tmp_path
):
    """`relax train` with PPO on 2 FSDP ranks: the critic trains on the ranks (its metrics every step) and
    the final checkpoint holds it beside the policy."""
    import json
    import math

    from relax.config import load_config
    from relax.orchestration.controller import Controller

    cfg = load_config(
        "tests/toy_arith.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            "algorithm.name=ppo",
            "trainer.num_steps=2",  # start-up outweighs the steps: two show the metrics on each
            "trainer.backend=fsdp",
            "trainer.num_ranks=2",
            "trainer.device=cpu",
            "rollout.prompts_per_step=8",
            "ops.checkpoint_interval=0",
            "ops.progress=false",
            "schedule.data_plane=ray",  # spares TransferQueue's actors: not the subject (docs/testing.md)
            *shared_engine.overrides(),  # the session's engine server (tests/conftest.py)
            "eval.sets=[]",
        ],
    )
    assert Controller(cfg).run() == 2
    rows = [json.loads(line) for line in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:  # (a step whose rewards are all 0 has zero returns, and the critic nothing to learn)
        assert r["critic/value_error"] >= 0 and math.isfinite(r["critic/grad_norm"]), r
    assert list(cfg.run.run_dir.glob("checkpoints/*/actor/critic/dcp/.metadata"))
