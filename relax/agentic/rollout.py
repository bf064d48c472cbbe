"""What the rollout loop calls for `rollout.agent.kind` other than `single_turn`: one prompt group of
multi-turn episodes or external-agent sessions, the multi-agent credit after scoring, and the agentic
metrics of a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relax.agentic.multi_agent import apply_advantage_fn, load_advantage_fn, pad_contexts
from relax.config import RelaxConfig
from relax.data.dataset import PromptRow
from relax.data.sample import Sample
from relax.rollout.partial_rollout import InflightRequests


class AgentRollout:
    def __init__(
        self, cfg: RelaxConfig, tokenizer: Any, inflight: InflightRequests, stop_token_ids: list[int]
    ) -> None:
        self.cfg = cfg
        self.agent = cfg.rollout.agent
        if self.agent.kind == "multi_turn":
            from relax.agentic.multi_turn import MultiTurnRollout

            self.impl: Any = MultiTurnRollout(cfg, tokenizer, inflight, stop_token_ids)
        elif self.agent.kind == "external":
            from relax.agentic.external import ExternalAgentRollout

            self.impl = ExternalAgentRollout(cfg, tokenizer, inflight, stop_token_ids)
        else:
            raise ValueError(f"AgentRollout does not run rollout.agent.kind={self.agent.kind!r}")
        self.advantage_fn = load_advantage_fn(self.agent.advantage_fn) if self.agent.advantage_fn else None
        self.filler = self.impl.formatter.eos_id

    async def generate_group(
        self, row: PromptRow, group_id: int, params: dict[str, Any], prompt_media: Any = None
    ) -> list[Sample]:
        if self.agent.kind == "multi_turn":
            samples = await self.impl.generate_group(row, group_id, params, prompt_media)
        else:
            samples = await self.impl.generate_group(row, group_id, params)
        if self.agent.contexts_per_sample > 1:
            for s in samples:
                pad_contexts(s, self.agent.contexts_per_sample, self.filler)
        return samples

    def after_scoring(self, samples: list[Sample]) -> None:
        """Multi-agent: share each scored group's outcome among its samples' contexts."""
        if self.advantage_fn is None:
            return
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_id, []).append(s)
        for group in groups.values():
            apply_advantage_fn(self.advantage_fn, group, self.agent.contexts_per_sample)

    async def close(self) -> None:
        if hasattr(self.impl, "close"):
            await self.impl.close()


def agent_factory(
    cfg: RelaxConfig, tokenizer: Any
) -> Callable[[InflightRequests, list[int]], AgentRollout] | None:
    """What `RolloutLoop` builds its agent with for `rollout.agent.kind`; None for single-turn rollouts."""
    if cfg.rollout.agent.kind == "single_turn":
        return None
    return lambda inflight, stop_token_ids: AgentRollout(cfg, tokenizer, inflight, stop_token_ids)
