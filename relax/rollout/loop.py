"""The single-turn rollout loop: prompts -> engine requests (one per prompt group, `n` samples sharing the
prompt's prefill) -> `Sample`s with tokens, behaviour log-probs and weight versions -> rewards.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from relax.config import RelaxConfig
from relax.data.dataset import PromptRow, tokenize_prompt
from relax.data.sample import Sample, SampleStatus
from relax.rewards.scorer import RewardScorer
from relax.rollout.metrics import rollout_metrics
from relax.rollout.partial_rollout import InflightRequests
from relax.rollout.router import Router

logger = logging.getLogger(__name__)

# (in-flight requests, stop token ids) -> the agent that generates one prompt group
AgentFactory = Callable[[InflightRequests, list[int]], Any]

FINISH_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


class RolloutLoop:
    def __init__(
        self,
        cfg: RelaxConfig,
        tokenizer: Any,
        router: Router,
        scorer: RewardScorer,
        agent: AgentFactory | None = None,
    ) -> None:
        """`agent`: builds what runs one prompt group when `rollout.agent.kind` is not `single_turn`
        (`relax.agentic.rollout.agent_factory`), given the loop's in-flight requests and stop tokens."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.router = router
        self.scorer = scorer
        r = cfg.rollout
        self.inflight = InflightRequests(
            router, partial=r.partial_rollout, max_aborts=r.max_aborts, partial_mode=r.partial_rollout_mode
        )
        self._prompt_cache: dict[int, list[int]] = {}
        self._media: Any = None  # MediaPool, started by the first row with media
        self.stop_token_ids = sorted(
            {
                t
                for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
                if t is not None
            }
        )
        # multi-turn / external agents (relax.agentic), by rollout.agent.kind
        if r.agent.kind != "single_turn" and agent is None:
            raise ValueError(f"rollout.agent.kind={r.agent.kind!r} needs an agent factory (relax.agentic)")
        self.agent: Any = agent(self.inflight, self.stop_token_ids) if agent is not None else None

    def sampling_params(self) -> dict[str, Any]:
        r = self.cfg.rollout
        return {
            "n": r.n_samples_per_prompt,
            "max_new_tokens": r.max_new_tokens,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k,
            "min_p": r.min_p,
            "stop": list(r.stop),
            "stop_token_ids": self.stop_token_ids,
        }

    def prompt_ids(self, row: PromptRow) -> list[int]:
        if row.index not in self._prompt_cache:
            d = self.cfg.data
            ids = tokenize_prompt(
                self.tokenizer, row.prompt, d.apply_chat_template, d.system_prompt, d.chat_template_kwargs
            )
            if len(ids) > d.max_prompt_len:
                # data.overlong_prompts removed such rows when the data loaded; this names one that
                # came another way (a custom agent, rows built in code)
                raise ValueError(
                    f"{row.where or f'row {row.index}'}: prompt has {len(ids)} tokens > data.max_prompt_len="
                    f"{d.max_prompt_len}; raise data.max_prompt_len or shorten the prompt"
                )
            self._prompt_cache[row.index] = ids
        return self._prompt_cache[row.index]

    async def prompt_inputs(self, row: PromptRow) -> tuple[list[int], dict[str, Any] | None]:
        """Prompt ids and media tensors; a row with media goes through the media worker pool."""
        if not row.media:
            return self.prompt_ids(row), None
        if self._media is None:
            from relax.data.mm_pool import MediaPool

            d = self.cfg.data
            self._media = MediaPool(
                self.cfg.model.path,
                d.media,
                system_prompt=d.system_prompt,
                template_kwargs=d.chat_template_kwargs,
            )
        out = await self._media.process(row)
        if len(out.prompt_ids) > self.cfg.data.max_prompt_len:
            raise ValueError(
                f"{row.where or f'row {row.index}'}: prompt has {len(out.prompt_ids)} tokens with its media > "
                f"data.max_prompt_len={self.cfg.data.max_prompt_len}; raise it or shrink the media"
            )
        return out.prompt_ids, out.multimodal_inputs

    def close(self) -> None:
        """Stop the media worker processes (if any were started)."""
        if self._media is not None:
            self._media.close()
            self._media = None
        if self.agent is not None and getattr(self.agent.impl, "server", None) is not None:
            self.agent.impl.server.should_stop()

    def after_scoring(self, samples: list[Sample]) -> None:
        """Multi-agent credit assignment of scored samples (a no-op for single-turn rollouts)."""
        if self.agent is not None:
            self.agent.after_scoring(samples)

    async def _generate_group(self, row: PromptRow, group_id: int, params: dict[str, Any]) -> list[Sample]:
        if self.agent is not None:
            media = await self.prompt_inputs(row) if row.media else None
            return await self.agent.generate_group(row, group_id, params, media)
        prompt_ids, media = await self.prompt_inputs(row)
        cap = row.metadata.get("max_new_tokens")  # optional per-row response cap (<= the config's)
        if cap is not None:
            params = {**params, "max_new_tokens": max(1, min(int(cap), int(params["max_new_tokens"])))}
        outputs = await self.inflight.generate_group(prompt_ids, params, multimodal_inputs=media)
        mask_old = self.cfg.rollout.mask_offpolicy_tokens
        samples = []
        for k, out in enumerate(outputs):
            mask = [1] * len(out.output_ids)
            if mask_old and out.offpolicy_len:
                mask[: out.offpolicy_len] = [0] * out.offpolicy_len
            samples.append(
                Sample.from_row(
                    row,
                    prompt_ids=list(prompt_ids),
                    multimodal_inputs=media,
                    group_id=group_id,
                    sample_id=k,
                    response_ids=list(out.output_ids),
                    response_text=out.text,
                    loss_mask=mask,
                    rollout_log_probs=list(out.log_probs),
                    status=FINISH_STATUS.get(out.finish_reason, SampleStatus.COMPLETED),
                    weight_versions=list(out.weight_versions),
                )
            )
        return samples

    async def generate(
        self,
        rows: list[PromptRow],
        first_group_id: int,
        params: dict[str, Any],
        scorer: Any,
        on_group: Callable[[], None] | None = None,
    ) -> tuple[list[Sample], dict[str, float]]:
        """Generate one group per row with `params`, score with `scorer`; returns samples, reward metrics.
        `on_group` is called as each row's group finishes generating (progress reports)."""

        async def one(row: PromptRow, group_id: int) -> list[Sample]:
            group = await self._generate_group(row, group_id, params)
            if on_group is not None:
                on_group()
            return group

        groups = await asyncio.gather(*(one(r, first_group_id + i) for i, r in enumerate(rows)))
        samples = [s for g in groups for s in g]
        for s in samples:
            if not s.response_text and s.response_ids:
                s.response_text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        metrics = (await scorer.score(samples)).as_metrics()
        self.after_scoring(samples)
        return samples, metrics

    async def run(self, rows: list[PromptRow], step: int) -> tuple[list[Sample], dict[str, float]]:
        """One training step's rollout."""
        samples, reward_metrics = await self.generate(
            rows, step * len(rows), self.sampling_params(), self.scorer
        )
        return samples, {**rollout_metrics(samples, step), **reward_metrics}
