"""Reward functions and the scorer that applies them (see ``registry`` for the reward contract).

Layer: rewards (ARCHITECTURE.md). May import data and utils only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax.rewards.config import RewardConfig
from relax.rewards.genrm import GenRMConfig
from relax.rewards.registry import REWARDS, RewardSpec, resolve_reward, reward_fn
from relax.rewards.scorer import RewardScorer, RewardStats

if TYPE_CHECKING:
    from relax.rewards.pool import PooledRewardScorer


def build_scorer(cfg: RewardConfig) -> RewardScorer | PooledRewardScorer:
    """The scorer ``cfg`` asks for: in process (``num_workers == 0``) or a pool of Ray workers."""
    if cfg.num_workers > 0:
        from relax.rewards.pool import PooledRewardScorer  # imports ray; only when a pool is asked for

        return PooledRewardScorer(cfg)
    return RewardScorer(cfg)


__all__ = [
    "REWARDS",
    "GenRMConfig",
    "RewardConfig",
    "RewardScorer",
    "RewardSpec",
    "RewardStats",
    "build_scorer",
    "resolve_reward",
    "reward_fn",
]
