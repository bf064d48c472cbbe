"""RL algorithms as pure tensor functions, selected by name through one registry (docs/algorithms.md).

The rest of Relax uses only: ``AlgorithmConfig`` (the config section), ``compute_advantages``
(controller), ``make_policy_loss`` / ``make_value_loss`` (trainer), and the DAPO data-side helpers
``filter_groups_dynamic_sampling`` / ``overlong_penalty`` (rollout).

Layer: algorithms (ARCHITECTURE.md). Pure tensor functions: imports nothing else of Relax.
"""

from relax.algorithms.config import AlgorithmConfig
from relax.algorithms.critic import ValueHeadModel, clipped_value_loss
from relax.algorithms.pipeline import (
    AdvantageOutput,
    PolicyLossFn,
    PolicyLossInputs,
    ValueLossInputs,
    compute_advantages,
    filter_groups_dynamic_sampling,
    make_policy_loss,
    make_value_loss,
    overlong_penalty,
)
from relax.algorithms.registry import ALGORITHMS, AlgorithmSpec, get_algorithm

__all__ = [
    "ALGORITHMS",
    "AdvantageOutput",
    "AlgorithmConfig",
    "AlgorithmSpec",
    "PolicyLossFn",
    "PolicyLossInputs",
    "ValueHeadModel",
    "ValueLossInputs",
    "clipped_value_loss",
    "compute_advantages",
    "filter_groups_dynamic_sampling",
    "get_algorithm",
    "make_policy_loss",
    "make_value_loss",
    "overlong_penalty",
]
