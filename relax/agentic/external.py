"""External agents: an agent program, run as a subprocess per sample, talks to Relax's OpenAI endpoint;
its calls are rebuilt into the sample's trajectory (`relax.agentic.trajectory`) and scored.

The program gets, in its environment:

* `RELAX_BASE_URL` (also `OPENAI_BASE_URL`): the session's base URL for any OpenAI client;
* `RELAX_SESSION_ID`: the session id; `OPENAI_API_KEY` (also `RELAX_API_KEY`): a token that opens this
  session alone (the run's own token never reaches the program);
* `RELAX_SAMPLE_FILE`: a JSON file with the sample's `prompt`, `label`, `metadata` and `index`.

`{base_url}`, `{session_id}` and `{sample_file}` in the command's arguments are filled in too. What the
program prints is kept in `Sample.metadata["agent_stdout"]` (last 4000 characters).

The sample is the branch holding the agent's last call; further branches (another role's context, or a
rewritten history) become `Sample.contexts`, oldest root first, when `contexts_per_sample > 1`, else
they are dropped and counted. A program that fails, times out or makes no call yields a sample with
termination `agent_failed` / `agent_timeout` / `no_calls` and an empty response (loss mask 0).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from relax.agentic.openai_server import OpenAIServer
from relax.agentic.session import ChatSession
from relax.agentic.trajectory import Trajectory
from relax.agentic.turns import TurnFormatter
from relax.config import RelaxConfig
from relax.data.dataset import PromptRow
from relax.data.sample import Sample, SampleStatus
from relax.rollout.partial_rollout import InflightRequests
from relax.utils.auth import TOKEN_ENV

logger = logging.getLogger(__name__)

STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


class ExternalAgentRollout:
    def __init__(
        self, cfg: RelaxConfig, tokenizer: Any, inflight: InflightRequests, stop_token_ids: list[int]
    ) -> None:
        self.cfg = cfg
        self.agent = cfg.rollout.agent
        self.tokenizer = tokenizer
        self.inflight = inflight
        self.stop_token_ids = list(stop_token_ids)
        self.formatter = TurnFormatter(tokenizer, cfg.model.path, cfg.data.chat_template_kwargs)
        self.server = OpenAIServer()
        self._sem: asyncio.Semaphore | None = None
        self.dropped_branches = 0

    async def _generate(self, prompt_ids: list[int], params: dict[str, Any], **client_kwargs: Any) -> Any:
        """One call's generation through the weight-update gate (streaming and top log-probs in
        `client_kwargs`); every sampling parameter the agent set reaches the engine."""
        (out,) = await self.inflight.generate(prompt_ids, params, **client_kwargs)
        return out

    def new_session(self, session_id: str) -> ChatSession:
        r = self.cfg.rollout
        defaults = {"temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "min_p": r.min_p}
        return ChatSession(
            session_id,
            self.formatter,
            self._generate,
            defaults=defaults,
            max_tokens_cap=self.agent.max_turn_tokens or r.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
        )

    async def generate_group(self, row: PromptRow, group_id: int, params: dict[str, Any]) -> list[Sample]:
        await self.server.start()
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.agent.max_concurrent_agents)
        n = int(params.get("n", 1))
        return list(await asyncio.gather(*(self.run_episode(row, group_id, k) for k in range(n))))

    async def run_episode(self, row: PromptRow, group_id: int, sample_id: int) -> Sample:
        sid = f"g{group_id}s{sample_id}-{uuid.uuid4().hex[:8]}"
        session = self.new_session(sid)
        self.server.open_session(session)
        base = Sample.from_row(
            row,
            group_id=group_id,
            sample_id=sample_id,
        )
        try:
            async with self._sem:
                termination, stdout = await self._run_program(row, sid)
        finally:
            self.server.close_session(sid)
        base.metadata["agent_stdout"] = stdout[-4000:]
        return self._to_sample(base, session, termination)

    async def _run_program(self, row: PromptRow, sid: str) -> tuple[str, str]:
        with tempfile.TemporaryDirectory(prefix="relax-agent-") as tmp:
            sample_file = Path(tmp) / "sample.json"
            sample_file.write_text(
                json.dumps(
                    {"prompt": row.prompt, "label": row.label, "metadata": row.metadata, "index": row.index}
                )
            )
            base_url = self.server.base_url(sid)
            fill = {"base_url": base_url, "session_id": sid, "sample_file": str(sample_file)}
            args = [a.format(**fill) for a in self.agent.command]
            token = self.server.issue_token(sid)
            env = {
                **{k: v for k, v in os.environ.items() if k != TOKEN_ENV},  # never the run's own token
                "RELAX_BASE_URL": base_url,
                "OPENAI_BASE_URL": base_url,
                "OPENAI_API_KEY": token,
                "RELAX_API_KEY": token,
                "RELAX_SESSION_ID": sid,
                "RELAX_SAMPLE_FILE": str(sample_file),
            }
            try:
                proc = await asyncio.create_subprocess_exec(
                    *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
                )
            except OSError as e:
                raise RuntimeError(
                    f"cannot start the agent program {args[0]!r} ({e}); check rollout.agent.command"
                ) from e
            try:
                out, err = await asyncio.wait_for(proc.communicate(), self.agent.agent_timeout_s)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                logger.warning(
                    "agent of session %s ran past %.0fs and was killed", sid, self.agent.agent_timeout_s
                )
                return "agent_timeout", ""
            stdout = out.decode(errors="replace")
            if proc.returncode != 0:
                logger.warning(
                    "agent of session %s exited with %s: %s",
                    sid,
                    proc.returncode,
                    err.decode(errors="replace")[-2000:],
                )
                return "agent_failed", stdout
            return "agent_done", stdout

    def _to_sample(self, base: Sample, session: ChatSession, termination: str) -> Sample:
        trajectories = session.recorder.build_trajectories()
        if not trajectories:
            return self._empty(base, "no_calls" if termination == "agent_done" else termination)
        last = len(session.recorder.calls) - 1
        main = next(t for t in trajectories if t.calls[-1] == last)
        others = sorted((t for t in trajectories if t is not main), key=lambda t: t.calls[0])
        sample = self._fill(base, main, session, termination)
        want = self.agent.contexts_per_sample - 1
        for t in others[:want]:
            ctx = Sample(index=base.index, prompt=base.prompt, label=base.label, metadata=base.metadata,
                         group_id=base.group_id, sample_id=base.sample_id)  # fmt: skip
            sample.contexts.append(self._fill(ctx, t, session, termination))
        self.dropped_branches += max(0, len(others) - want)
        if termination != "agent_done":
            sample.status = SampleStatus.FAILED
        return sample

    def _fill(self, s: Sample, t: Trajectory, session: ChatSession, termination: str) -> Sample:
        s.prompt_ids, s.response_ids = t.prompt_ids, t.response_ids
        s.loss_mask, s.rollout_log_probs, s.weight_versions = (
            t.loss_mask,
            t.rollout_log_probs,
            t.weight_versions,
        )
        s.status = STATUS.get(t.finish_reason, SampleStatus.COMPLETED)
        s.termination = termination
        p = len(t.prompt_ids)
        for i in t.calls:
            rec = session.recorder.calls[i]
            start = len(rec.prompt_ids) - p
            s.turns.append(
                {
                    "start": start,
                    "end": start + len(rec.output_ids),
                    "text": self.tokenizer.decode(rec.output_ids, skip_special_tokens=False),
                    "tool_calls": [
                        {"name": c["function"]["name"], "arguments": c["function"]["arguments"], "error": ""}
                        for c in rec.reply_message.get("tool_calls", [])
                    ],
                    "call": i,
                }
            )
        final = session.recorder.calls[t.calls[-1]].reply_message
        s.response_text = str(final.get("content") or "")
        return s

    def _empty(self, base: Sample, termination: str) -> Sample:
        """A sample with nothing to train on: the prompt, one end-of-turn token with loss mask 0."""
        base.prompt_ids = self.formatter.prompt_ids(base.prompt)
        base.response_ids = [self.formatter.eos_id]
        base.loss_mask, base.rollout_log_probs = [0], [0.0]
        base.status, base.termination = SampleStatus.FAILED, termination
        return base

    async def close(self) -> None:
        await self.server.stop()
