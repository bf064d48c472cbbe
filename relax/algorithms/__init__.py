"""RL algorithms as pure tensor functions, selected by name through one registry (docs/algorithms.md).

The rest of Relax uses only: ``AlgorithmConfig`` (the config section), ``compute_advantages``
(controller), ``make_policy_loss`` / ``make_value_loss`` (trainer), and the DAPO data-side helpers
``filter_groups_dynamic_sampling`` / ``overlong_penalty`` (rollout).

Layer: algorithms (ARCHITECTURE.md). Pure tensor functions: imports nothing else of Relax.
"""

from typing import Any

# Loaded on first use (PEP 562): the config section and the registry need no torch, and the processes
# that read a config but compute no loss (the driver, the Metrics role, a node check) skip its import.
_WHERE = {
    "AlgorithmConfig": "config",
    "ValueHeadModel": "critic",
    "clipped_value_loss": "critic",
    "AdvantageOutput": "pipeline",
    "PolicyLossFn": "pipeline",
    "PolicyLossInputs": "pipeline",
    "ValueLossInputs": "pipeline",
    "compute_advantages": "pipeline",
    "filter_groups_dynamic_sampling": "pipeline",
    "make_policy_loss": "pipeline",
    "make_value_loss": "pipeline",
    "overlong_penalty": "pipeline",
    "ALGORITHMS": "registry",
    "AlgorithmSpec": "registry",
    "get_algorithm": "registry",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


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
