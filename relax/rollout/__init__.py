"""Rollout: the rollout loop (prompts -> engine requests -> scored `Sample`s), the router over engines,
partial rollout, step production and assembly, staleness gating, evaluation and rollout metrics.

Layer: rollout (ARCHITECTURE.md). May import backends, engine_api, config, rewards, algorithms, data, utils.
"""
