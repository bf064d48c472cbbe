"""The multi-turn rollout: model turns alternate with environment observations, token-in, token-out.

One sample's episode::

    tokens = prompt
    repeat up to max_turns:
        turn  = /generate(tokens)             # a new engine request with the full prefix; it ends at
                                              # end-of-turn or </tool_call>, freeing the engine slot
        tokens += turn        (loss mask 1, behaviour log-probs from the engine)
        result = env.step(turn)               # tools run here, with no engine request open
        if result.done: stop
        tokens += observation (loss mask 0, log-prob 0)

The episode also ends when a turn hits its token cap (`turn_truncated`), when the next observation
would not fit the total budget `max_total_tokens` (`token_budget`), or after `max_turns` turns
(`max_turns`); the reason is `Sample.termination`. `response_ids` are exactly the generated and
appended tokens (never re-tokenized text); `loss_mask` and `rollout_log_probs` have one entry per
response token. A weight update that aborts a turn (partial rollout) continues that turn under the
new weights.
"""

from __future__ import annotations

import logging
from typing import Any

from relax.agentic.env import Environment, Message, ModelTurn, env_factory
from relax.agentic.parser import TOOL_CALL_CLOSE, parse_tool_calls
from relax.agentic.turns import TurnFormatter, merge_media
from relax.config import RelaxConfig
from relax.data.dataset import PromptRow
from relax.data.sample import Sample, SampleStatus
from relax.engine_api.protocol import version_from_engine
from relax.rollout.partial_rollout import InflightRequests

logger = logging.getLogger(__name__)


class MultiTurnRollout:
    def __init__(
        self,
        cfg: RelaxConfig,
        tokenizer: Any,
        inflight: InflightRequests,
        stop_token_ids: list[int],
    ) -> None:
        self.cfg = cfg
        self.agent = cfg.rollout.agent
        self.tokenizer = tokenizer
        self.inflight = inflight
        self.factory = env_factory(self.agent.env)
        self.formatter = TurnFormatter(tokenizer, cfg.model.path, cfg.data.chat_template_kwargs)
        self.close_id = tokenizer.convert_tokens_to_ids(TOOL_CALL_CLOSE)
        stops = set(stop_token_ids)
        if self.agent.stop_at_tool_call and self.close_id is not None:
            stops.add(self.close_id)
        self.stop_token_ids = sorted(stops)
        self.end_ids = set(stop_token_ids)  # tokens that end a turn in the chat format

    def make_env(self) -> Environment:
        kwargs = dict(self.agent.env_kwargs)
        kwargs.setdefault("timeout_s", self.agent.tool_timeout_s)
        return self.factory(**kwargs)

    def prompt_ids(self, row: PromptRow, env: Environment) -> list[int]:
        d = self.cfg.data
        tools = [t.schema() for t in getattr(env, "tools", [])] if self.agent.tools_in_prompt else None
        ids = self.formatter.prompt_ids(
            row.prompt, apply_chat_template=d.apply_chat_template, system_prompt=d.system_prompt, tools=tools
        )
        if len(ids) > d.max_prompt_len:
            raise ValueError(
                f"{row.where or f'row {row.index}'}: prompt has {len(ids)} tokens with its tools > "
                f"data.max_prompt_len="
                f"{d.max_prompt_len}; raise data.max_prompt_len or set rollout.agent.tools_in_prompt=false"
            )
        return ids

    async def generate_group(
        self,
        row: PromptRow,
        group_id: int,
        params: dict[str, Any],
        prompt_media: tuple[list[int], dict[str, Any] | None] | None = None,
    ) -> list[Sample]:
        """`params['n']` independent episodes of one prompt."""
        import asyncio

        n = int(params.get("n", 1))
        return list(
            await asyncio.gather(
                *(self.run_episode(row, group_id, k, params, prompt_media) for k in range(n))
            )
        )

    async def run_episode(
        self,
        row: PromptRow,
        group_id: int,
        sample_id: int,
        params: dict[str, Any],
        prompt_media: tuple[list[int], dict[str, Any] | None] | None = None,
    ) -> Sample:
        env = self.make_env()
        try:
            if prompt_media is not None and prompt_media[1] is not None:
                prompt_ids, media = prompt_media  # a multimodal prompt (its tokens already expanded)
            else:
                prompt_ids, media = self.prompt_ids(row, env), None
            sample = Sample.from_row(
                row,
                prompt_ids=list(prompt_ids),
                multimodal_inputs=media,
                group_id=group_id,
                sample_id=sample_id,
            )
            first = await env.reset(sample)
            if first:
                ids, new_media = self.formatter.observation(first, turn_ended=True)
                sample.prompt_ids += ids  # context given before the first turn is part of the prompt
                sample.multimodal_inputs = merge_media(sample.multimodal_inputs, new_media)
            await self._episode(sample, env, params)
        finally:
            await env.close()
        sample.response_text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        return sample

    async def _generate_turn(
        self, sample: Sample, params: dict[str, Any], cap: int
    ) -> tuple[list, list, str]:
        """One model turn (continued across aborts by weight updates); (ids, log-probs, finish)."""
        ids: list[int] = []
        lps: list[float] = []
        finish = "abort"
        aborts = -1  # weight updates that interrupted this turn (InflightRequests caps them)
        while finish == "abort" and len(ids) < cap:
            aborts += 1
            turn_params = {
                **params,
                "n": 1,
                "max_new_tokens": cap - len(ids),
                "stop_token_ids": self.stop_token_ids,
            }
            (out,) = await self.inflight.generate(
                sample.tokens + ids, turn_params, aborts=aborts, multimodal_inputs=sample.multimodal_inputs
            )
            ids += list(out.output_ids)
            lps += list(out.output_log_probs)
            finish = out.finish_reason
            # several versions: updated in place while it ran
            for v in map(version_from_engine, out.weight_versions or [out.weight_version]):
                if not sample.weight_versions or sample.weight_versions[-1] != v:
                    sample.weight_versions.append(v)
            if finish == "abort" and self.inflight.router_closed():
                break
        if finish == "abort" and len(ids) >= cap:
            finish = "length"
        return ids, lps, finish

    async def _episode(self, sample: Sample, env: Environment, params: dict[str, Any]) -> None:
        a = self.agent
        turn_cap = a.max_turn_tokens or self.cfg.rollout.max_new_tokens
        sample.termination = "max_turns"
        for t in range(a.max_turns):
            left = a.max_total_tokens - sample.response_length
            if left <= 0:
                sample.termination = "token_budget"
                break
            ids, lps, finish = await self._generate_turn(sample, params, min(turn_cap, left))
            start = sample.response_length
            sample.response_ids += ids
            sample.loss_mask += [1] * len(ids)
            sample.rollout_log_probs += [float(x) for x in lps]
            if len(lps) != len(ids):
                raise RuntimeError(
                    f"the engine returned {len(lps)} log-probs for {len(ids)} tokens; multi-turn rollouts "
                    "need per-token behaviour log-probs (return_logprob)"
                )
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            record: dict[str, Any] = {"start": start, "end": sample.response_length, "text": text}
            sample.turns.append(record)
            if finish == "abort":
                sample.termination, sample.status = "aborted", SampleStatus.ABORTED
                return
            compact = getattr(env, "compact_tool", None)
            turn = ModelTurn(text, ids, parse_tool_calls(text, compact), finish, t)
            record["tool_calls"] = [
                {"name": c.name, "arguments": c.arguments, "error": c.error} for c in turn.tool_calls
            ]
            if finish == "length" and (a.end_on_truncated_turn or len(ids) < turn_cap):
                sample.termination = "turn_truncated" if len(ids) >= turn_cap else "token_budget"
                break
            result = await env.step(turn)
            record["results"] = [
                {"name": r.name, "ok": r.ok, "error": r.error, "text": r.text} for r in result.tool_results
            ]
            record.update(result.info)
            if result.done:
                sample.termination = "env_done"
                break
            if t == a.max_turns - 1:
                break  # no observation after the last turn
            if not await self._observe(
                sample, result.observation, ended=bool(ids) and ids[-1] in self.end_ids
            ):
                break
        sample.status = SampleStatus.COMPLETED if sample.termination == "env_done" else SampleStatus.TRUNCATED

    async def _observe(self, sample: Sample, messages: list[Message], ended: bool) -> bool:
        """Append an observation; False (and termination `token_budget`) when it does not fit."""
        ids, media = self.formatter.observation(messages, turn_ended=ended)
        if sample.response_length + len(ids) >= self.agent.max_total_tokens:
            sample.termination = "token_budget"
            return False
        start = sample.response_length
        sample.response_ids += ids
        sample.loss_mask += [0] * len(ids)
        sample.rollout_log_probs += [0.0] * len(ids)
        sample.multimodal_inputs = merge_media(sample.multimodal_inputs, media)
        sample.turns[-1].update(obs_start=start, obs_end=sample.response_length)
        return True
