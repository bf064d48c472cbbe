"""Helpers of the agentic tests."""

from __future__ import annotations

import asyncio

from relax.config.schema import RelaxConfig


def run(coro):
    return asyncio.run(coro)


def agent_config(model_dir, **agent) -> RelaxConfig:
    rollout = {"n_samples_per_prompt": 2, "max_new_tokens": 6, "temperature": 1.0, "agent": agent}
    return RelaxConfig(
        model={"path": str(model_dir)},
        data={"train_files": ["unused.jsonl"]},
        rollout=rollout,
    )
