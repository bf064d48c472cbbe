"""Normalizers and advantage estimators against hand-computed values."""

import math

import pytest
import torch

from relax.algorithms import AlgorithmConfig, compute_advantages
from relax.algorithms.advantages import (
    broadcast,
    discounted_returns,
    gae,
    last_token_mask,
    reinforce_plus_plus,
)
from relax.algorithms.masked import masked_whiten
from relax.algorithms.normalizers import group_mean, group_mean_std, leave_one_out, no_normalization


def test_group_mean_and_leave_one_out():
    r = torch.tensor([1.0, 2.0, 6.0, 5.0, 7.0])
    g = torch.tensor([0, 0, 0, 1, 1])
    torch.testing.assert_close(group_mean(r, g), torch.tensor([-2.0, -1.0, 3.0, -1.0, 1.0]))
    # RLOO: r_i - mean of the others: 1-(8/2), 2-(7/2), 6-(3/2), 5-7, 7-5
    torch.testing.assert_close(leave_one_out(r, g), torch.tensor([-3.0, -1.5, 4.5, -2.0, 2.0]))
    torch.testing.assert_close(no_normalization(r, g), r)


def test_group_mean_std_hand_value():
    r, g = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([3, 3, 3])
    torch.testing.assert_close(group_mean_std(r, g), torch.tensor([-1.0, 0.0, 1.0]) / (1.0 + 1e-6))


@pytest.mark.parametrize("fn", [group_mean_std, group_mean, leave_one_out])
def test_group_normalizers_reject_singletons_and_are_finite_on_ties(fn):
    with pytest.raises(ValueError, match="size"):
        fn(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 1]))
    out = fn(torch.tensor([2.0, 2.0, 2.0]), torch.tensor([0, 0, 0]))
    assert torch.equal(out, torch.zeros(3))


def test_last_token_mask_and_broadcast():
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 1], [0, 0, 0]])
    torch.testing.assert_close(last_token_mask(mask), torch.tensor([[0.0, 1, 0], [0, 0, 1], [0, 0, 0]]))
    torch.testing.assert_close(
        broadcast(torch.tensor([2.0, -1.0, 5.0]), mask), torch.tensor([[2.0, 2, 0], [-1, 0, -1], [0, 0, 0]])
    )


def test_discounted_returns_skip_env_tokens():
    rewards = torch.tensor([[1.0, 9.0, 2.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])  # token 1 is an environment token
    # G3 = 4, G2 = 2 + .5*4 = 4, G1 skipped, G0 = 1 + .5*4 = 3
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), torch.tensor([[3.0, 0.0, 4.0, 4.0]]))


def test_gae_hand_values():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.4]])
    mask = torch.ones(1, 3)
    gamma, lam = 0.9, 0.5
    d2 = 1.0 - 0.4
    d1 = 0.0 + gamma * 0.4 - 0.2
    d0 = 0.0 + gamma * 0.2 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    adv, ret = gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.2, a2 + 0.4]]))
    # bootstrap value for a truncated response: delta_2 gains gamma * V_boot
    adv_b, _ = gae(rewards, values, mask, gamma, lam, bootstrap_values_N=torch.tensor([1.0]))
    assert adv_b[0, 2].item() == pytest.approx(d2 + gamma * 1.0)


def test_gae_no_gradient_and_padding_zero():
    values = torch.tensor([[0.3, 0.1, 0.7]], requires_grad=True)
    adv, ret = gae(torch.tensor([[0.0, 1.0, 5.0]]), values, torch.tensor([[1.0, 1.0, 0.0]]), 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad
    # last valid token is 1: V after it is 0 (terminal), the padded reward 5 is ignored
    torch.testing.assert_close(adv, torch.tensor([[1.0 - 0.3, 1.0 - 0.1, 0.0]]))


def test_masked_whiten():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # mean 2, unbiased var 2
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([[-1.0, 1.0, 0.0]]) / math.sqrt(2 + 1e-8))
    assert torch.isfinite(masked_whiten(x, torch.zeros_like(mask))).all()


def test_reinforce_plus_plus_whitens_returns_globally():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    mask = torch.ones(2, 2)
    adv, ret = reinforce_plus_plus(rewards, mask, gamma=1.0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [3.0, 3.0]]))
    std = math.sqrt(4 / 3)  # returns {1,1,3,3}: mean 2, unbiased var 4/3
    torch.testing.assert_close(adv, torch.tensor([[-1.0, -1.0], [1.0, 1.0]]) / std, atol=1e-6, rtol=1e-6)


def test_pipeline_reinforce_pp_with_reward_kl():
    cfg = AlgorithmConfig(name="reinforce_plus_plus", reward_kl_coef=0.5, gamma=1.0)
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -2.0]])
    ref = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])  # k1 = lp - ref = [[0, 1], [0, -1]]
    out = compute_advantages(cfg, torch.tensor([1.0, 1.0]), torch.tensor([0, 1]), torch.ones(2, 2),
                             log_probs_NT=lp, ref_log_probs_NT=ref)  # fmt: skip
    # token rewards: [[0, -0.5 + 1], [0, 0.5 + 1]] -> returns [[0.5, 0.5], [1.5, 1.5]]
    torch.testing.assert_close(out.returns_NT, torch.tensor([[0.5, 0.5], [1.5, 1.5]]))
    assert out.metrics["reward_kl"] == pytest.approx(0.0)


def test_pipeline_reward_kl_enters_sequence_reward_for_grpo():
    cfg = AlgorithmConfig(reward_kl_coef=1.0, normalize_std=False)
    lp = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    ref = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])  # KL sums 2 and 0 -> rewards 1-2, 1-0
    out = compute_advantages(cfg, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, 2),
                             log_probs_NT=lp, ref_log_probs_NT=ref)  # fmt: skip
    torch.testing.assert_close(out.advantages_NT, torch.tensor([[-1.0, -1.0], [1.0, 1.0]]))


def test_pipeline_ppo_needs_values_and_returns_them():
    cfg = AlgorithmConfig(name="ppo", whiten_advantages=False, lam=1.0)
    with pytest.raises(ValueError, match="critic"):
        compute_advantages(cfg, torch.tensor([1.0]), torch.tensor([0]), torch.ones(1, 2))
    out = compute_advantages(cfg, torch.tensor([1.0]), torch.tensor([0]), torch.ones(1, 2),
                             values_NT=torch.tensor([[0.25, 0.5]]))  # fmt: skip
    torch.testing.assert_close(out.advantages_NT, torch.tensor([[0.75, 0.5]]))
    torch.testing.assert_close(out.returns_NT, torch.tensor([[1.0, 1.0]]))


def test_pipeline_rloo_and_rpp_baseline():
    r, g, m = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0, 0, 0]), torch.ones(3, 1)
    out = compute_advantages(AlgorithmConfig(name="rloo"), r, g, m)
    torch.testing.assert_close(out.advantages_NT[:, 0], torch.tensor([1.0, -0.5, -0.5]))
    out = compute_advantages(AlgorithmConfig(name="reinforce_plus_plus_baseline"), r, g, m)
    base = torch.tensor([2 / 3, -1 / 3, -1 / 3])  # group-centred, then whitened over the 3 tokens
    torch.testing.assert_close(out.advantages_NT[:, 0], base / base.std(), atol=1e-5, rtol=1e-5)
