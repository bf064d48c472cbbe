"""The agent endpoint serves the same OpenAI API as an engine's `/v1`: an agent program runs every check
of tests/openai_checks.py through it (n > 1 refused with its reason), its calls are recorded, and a stop
string reaches the engine (the recorded call ends at it, not at max_tokens)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from agentic_helpers import agent_config, run, run_external

from tests import openai_checks

AGENTS = Path(__file__).parent / "agents"


def test_agent_endpoint_passes_the_openai_checks(engine_server, tokenizer, tiny_model_dir, tmp_path):
    cfg = agent_config(
        tiny_model_dir,
        kind="external",
        command=[sys.executable, str(AGENTS / "openai_agent.py")],
        agent_timeout_s=300,
        max_turn_tokens=96,
    )
    cfg.rollout.n_samples_per_prompt = 1
    samples, impl = run(run_external(cfg, tokenizer, engine_server.url))
    (s,) = samples
    assert s.termination == "agent_done", s.metadata.get("agent_stdout")
    assert json.loads(s.metadata["agent_stdout"]) == [
        "models", "chat", "stop", "seed", "n", "logprobs", "streaming", "tools", "stream_tool_calls",
        "response_format", "completions", "errors",
    ]  # fmt: skip
    assert s.loss_mask and sum(s.loss_mask) > 0  # the last call's branch is a trainable sample
    assert impl.dropped_branches > 10  # every check started its own conversation


def test_stop_reaches_the_engine(engine_server, tokenizer, tiny_model_dir):
    """A stop string ends the call in the engine: the recorded output stops at it, short of max_tokens."""
    from relax.agentic.external import ExternalAgentRollout
    from relax.rollout.partial_rollout import InflightRequests
    from relax.rollout.router import Router

    cfg = agent_config(tiny_model_dir, kind="external", command=["unused"], max_turn_tokens=32)

    async def go():
        router = Router([engine_server.url], timeout_s=120)
        ext = ExternalAgentRollout(cfg, tokenizer, InflightRequests(router), [tokenizer.eos_token_id])
        session = ext.new_session("s0")
        ext.server.open_session(session)
        await ext.server.start()
        import openai

        client = openai.AsyncOpenAI(base_url=ext.server.base_url("s0"), api_key="x", max_retries=0)
        free = await client.chat.completions.create(model="m", messages=openai_checks.USER, max_tokens=24,
                                                    **openai_checks.GREEDY)  # fmt: skip
        text = free.choices[0].message.content
        stop = text[3:5]
        cut = await client.chat.completions.create(model="m", messages=openai_checks.USER, max_tokens=24, stop=[stop],
                                                   **openai_checks.GREEDY)  # fmt: skip
        await ext.close()
        await router.close()
        return text, stop, cut, session.recorder.calls

    text, stop, cut, calls = run(go())
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert len(calls) == 2 and len(calls[0].output_ids) == 24 and len(calls[1].output_ids) < 24
    assert calls[1].finish_reason == "stop"
