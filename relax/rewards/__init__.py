"""Reward functions and the scorer that applies them (see ``registry`` for the reward contract)."""

from relax.rewards.config import RewardConfig
from relax.rewards.registry import REWARDS, RewardSpec, resolve_reward, reward_fn
from relax.rewards.scorer import RewardScorer, RewardStats

__all__ = [
    "REWARDS",
    "RewardConfig",
    "RewardScorer",
    "RewardSpec",
    "RewardStats",
    "resolve_reward",
    "reward_fn",
]
