"""Helpers of the agentic tests."""

from __future__ import annotations

import asyncio

from relax.config import RelaxConfig


def run(coro):
    return asyncio.run(coro)


def agent_config(model_dir, **agent) -> RelaxConfig:
    rollout = {"n_samples_per_prompt": 2, "max_new_tokens": 6, "temperature": 1.0, "agent": agent}
    return RelaxConfig(
        model={"path": str(model_dir)},
        data={"train_files": ["unused.jsonl"]},
        rollout=rollout,
    )


async def run_external(cfg: RelaxConfig, tokenizer, url: str, prompt: str = "What is 3+4?"):
    """One prompt's samples through the rollout loop with an external agent; (samples, the agent rollout)."""
    from relax.agentic.rollout import agent_factory
    from relax.data.dataset import PromptRow
    from relax.rewards import build_scorer
    from relax.rollout.loop import RolloutLoop
    from relax.rollout.router import Router

    router = Router([url], timeout_s=300)
    loop = RolloutLoop(cfg, tokenizer, router, build_scorer(cfg.reward), agent_factory(cfg, tokenizer))
    try:
        samples, _ = await loop.generate(
            [PromptRow(0, prompt, label="7")], 0, loop.sampling_params(), loop.scorer
        )
        return samples, loop.agent.impl
    finally:
        await loop.agent.close()
        await router.close()
