"""Advantage estimators: per-sample scores / per-token rewards -> per-token advantages [N, T].

Every estimator returns ``(advantages_NT, returns_NT | None)`` with zeros outside ``mask_NT``.
``token_rewards_NT`` holds the reward-side KL shaping (-beta*k1, zeros when off); the sequence score
(the normalised scalar reward) is added at each sequence's last masked token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from relax.algorithms.masked import masked_whiten


def last_token_mask(mask_NT: Tensor) -> Tensor:
    """1 at the last masked token of each row, 0 elsewhere (all 0 for a fully masked row), [N, T]."""
    T = mask_NT.shape[-1]
    positions_NT = torch.arange(T, device=mask_NT.device).expand_as(mask_NT)
    last_N = torch.where(mask_NT.bool(), positions_NT, -1).max(dim=-1).values  # -1 if the row is empty
    return (positions_NT == last_N.unsqueeze(-1)).to(mask_NT.dtype)


def broadcast(scores_N: Tensor, mask_NT: Tensor) -> Tensor:
    r"""Outcome advantage: :math:`\hat A_{i,t} = s_i` for every masked token of sequence i (GRPO, RLOO)."""
    return scores_N.unsqueeze(-1).to(mask_NT.dtype) * mask_NT


def discounted_returns(token_rewards_NT: Tensor, mask_NT: Tensor, gamma: float) -> Tensor:
    r"""Return-to-go over masked tokens: :math:`G_t = r_t + \gamma G_{t'}`, t' the next masked token.

    Unmasked tokens (padding, environment tokens between turns) are skipped: they neither add reward
    nor discount.
    """
    returns_NT = torch.zeros_like(token_rewards_NT)
    running_N = torch.zeros_like(token_rewards_NT[:, 0])
    for t in reversed(range(token_rewards_NT.shape[-1])):
        m = mask_NT[:, t]
        running_N = m * (token_rewards_NT[:, t] + gamma * running_N) + (1 - m) * running_N
        returns_NT[:, t] = running_N * m
    return returns_NT


def gae(
    token_rewards_NT: Tensor,
    values_NT: Tensor,
    mask_NT: Tensor,
    gamma: float,
    lam: float,
    bootstrap_values_N: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438).

    :math:`\delta_t = r_t + \gamma V_{t+1} - V_t`, :math:`\hat A_t = \delta_t + \gamma\lambda \hat A_{t+1}`,
    returns :math:`R_t = \hat A_t + V_t` (the critic's regression target). After the last token
    :math:`V = 0` (terminal), or ``bootstrap_values_N`` for a truncated response. Departure: "next" means
    the next MASKED token, so environment tokens inside a multi-turn response are skipped.
    Inputs are detached: advantages and returns carry no gradient.
    """
    rewards, values, mask = token_rewards_NT.detach(), values_NT.detach(), mask_NT.to(values_NT.dtype)
    N, T = rewards.shape
    next_value_N = torch.zeros(N, dtype=values.dtype, device=values.device)
    if bootstrap_values_N is not None:
        next_value_N = bootstrap_values_N.detach().to(values.dtype)
    last_gae_N = torch.zeros_like(next_value_N)
    advantages = torch.zeros_like(values)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value_N - values[:, t]
        gae_t = delta + gamma * lam * last_gae_N
        last_gae_N = m * gae_t + (1 - m) * last_gae_N
        next_value_N = m * values[:, t] + (1 - m) * next_value_N
        advantages[:, t] = gae_t * m
    returns = (advantages + values) * mask
    return advantages, returns


def reinforce_plus_plus(token_rewards_NT: Tensor, mask_NT: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    r"""REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return with k1 KL shaping, globally whitened.

    :math:`r_t = -\beta\,k_1(t) + \mathbb 1[t = \text{last}]\,s_i`, :math:`G_t = \sum_{k \ge t}\gamma^{k-t} r_k`,
    :math:`\hat A = (G - \mu_G)/\sigma_G` over all masked tokens of the batch. With a group-mean
    baseline in :math:`s_i` this is REINFORCE++-baseline. No departure.
    """
    returns_NT = discounted_returns(token_rewards_NT.detach(), mask_NT, gamma)
    return masked_whiten(returns_NT, mask_NT), returns_NT


@dataclass
class EstimatorInputs:
    """What every estimator is handed (one global batch of N samples)."""

    scores_N: Tensor  # normalised scalar reward per sample
    token_rewards_NT: Tensor  # per-token reward-side KL shaping (zeros when off)
    mask_NT: Tensor  # 1 on trained response tokens
    values_NT: Tensor | None  # critic values (GAE only)
    gamma: float  # discount per token
    lam: float  # GAE lambda
    whiten: bool  # GAE: whiten advantages over all masked tokens


def _broadcast(x: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    return broadcast(x.scores_N, x.mask_NT), None


def _gae(x: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    if x.values_NT is None:
        raise ValueError("the GAE estimator needs critic values (values_NT); is the critic configured?")
    rewards_NT = x.token_rewards_NT + broadcast(x.scores_N, last_token_mask(x.mask_NT))
    advantages_NT, returns_NT = gae(rewards_NT, x.values_NT, x.mask_NT, x.gamma, x.lam)
    if x.whiten:
        advantages_NT = masked_whiten(advantages_NT, x.mask_NT)
    return advantages_NT, returns_NT


def _reinforce_plus_plus(x: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    rewards_NT = x.token_rewards_NT + broadcast(x.scores_N, last_token_mask(x.mask_NT))
    return reinforce_plus_plus(rewards_NT, x.mask_NT, x.gamma)


def _zeros(x: EstimatorInputs) -> tuple[Tensor, Tensor | None]:
    return torch.zeros_like(x.mask_NT, dtype=x.token_rewards_NT.dtype), None


Estimator = Callable[[EstimatorInputs], "tuple[Tensor, Tensor | None]"]

# To add an estimator: write it above and register it here; if it consumes the per-token reward-side
# KL itself, list it in TOKEN_REWARD_ESTIMATORS (otherwise the KL is subtracted from the scalar reward
# before normalisation).
ESTIMATORS: dict[str, Estimator] = {
    "broadcast": _broadcast,
    "gae": _gae,
    "reinforce_plus_plus": _reinforce_plus_plus,
    "distillation": _zeros,  # the distillation term is added on top by the pipeline
}
TOKEN_REWARD_ESTIMATORS = frozenset({"gae", "reinforce_plus_plus"})
