"""External agents: a program written with the `openai` client drives a real session over HTTP (Relax's
OpenAI endpoint, the router, a real embedded engine); its trajectory is rebuilt token for token from
the calls it made, a rewritten history starts a branch, and a planner/worker program yields one sample
with two contexts that become two training rows carrying the user's values."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from agentic_helpers import agent_config, run

from relax.agentic.rollout import agent_factory
from relax.data.dataset import PromptRow
from relax.data.rows import samples_to_rows
from relax.rewards import build_scorer
from relax.rollout.loop import RolloutLoop
from relax.rollout.router import Router

AGENTS = Path(__file__).parent / "agents"


async def _external(cfg, tokenizer, url, prompt="What is 3+4?"):
    router = Router([url], timeout_s=120)
    loop = RolloutLoop(cfg, tokenizer, router, build_scorer(cfg.reward), agent_factory(cfg, tokenizer))
    try:
        samples, _ = await loop.generate(
            [PromptRow(0, prompt, label="7")], 0, loop.sampling_params(), loop.scorer
        )
        return samples, loop.agent.impl
    finally:
        await loop.agent.close()
        await router.close()


def _model_spans(s):
    spans, start = [], None
    for i, m in enumerate([*s.loss_mask, 0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_openai_client_agent_trajectory_is_rebuilt_exactly(engine_server, tokenizer, tiny_model_dir):
    cfg = agent_config(
        tiny_model_dir,
        kind="external",
        command=[sys.executable, str(AGENTS / "chat_agent.py")],
        agent_timeout_s=120,
    )
    samples, impl = run(_external(cfg, tokenizer, engine_server.url))
    assert len(samples) == 2
    for s in samples:
        assert s.termination == "agent_done", s.metadata.get("agent_stdout")
        seen = json.loads(s.metadata["agent_stdout"])
        assert len(seen) == 3 and len(s.turns) == 3
        # the prompt is the first call's chat-templated request, tools listed in the system turn
        expected_prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 3+4?"}],
            tools=[{"type": "function", "function": json.loads(json.dumps(_calc_schema()))}],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert s.prompt_ids == tokenizer.encode(expected_prompt, add_special_tokens=False)
        # model tokens: exactly the three calls' outputs, in order, with their engine log-probs
        spans = _model_spans(s)
        assert [(t["start"], t["end"]) for t in s.turns] == spans
        for (a, b), reply in zip(spans, seen, strict=True):
            # the reply's content is the engine's text: special tokens skipped, as OpenAI servers do
            text = tokenizer.decode(s.response_ids[a:b], skip_special_tokens=True)
            assert text.strip() == (reply.get("content") or "").strip()
            assert all(lp < 0 for lp in s.rollout_log_probs[a:b])
        # between two calls: the template's text for the agent's next user message, never re-encoded
        # model text
        for k, ((_, b), (a2, _)) in enumerate(zip(spans, spans[1:], strict=False)):
            between = tokenizer.decode(s.response_ids[b:a2], skip_special_tokens=False)
            assert between.endswith(
                f"<|im_start|>user\nStep {k} done. Go on.<|im_end|>\n<|im_start|>assistant\n"
            )
            assert all(m == 0 for m in s.loss_mask[b:a2])
        assert s.response_text == (seen[-1].get("content") or "")
    assert impl.dropped_branches == 0


def test_rewritten_history_starts_a_branch(engine_server, tokenizer, tiny_model_dir):
    cfg = agent_config(
        tiny_model_dir,
        kind="external",
        command=[sys.executable, str(AGENTS / "chat_agent.py"), "--branch"],
        agent_timeout_s=120,
    )
    samples, impl = run(_external(cfg, tokenizer, engine_server.url))
    for s in samples:
        seen = json.loads(s.metadata["agent_stdout"])
        assert len(seen) == 4
        # the last call continues call 0 (history [u, a0, u] was kept, the middle exchange dropped)
        assert [t["call"] for t in s.turns] == [0, 3]
        assert s.response_text == (seen[-1].get("content") or "")
    assert impl.dropped_branches == 2  # the original three-call branch of each sample


@pytest.mark.parametrize(
    ("code", "timeout", "termination"),
    [("import sys; sys.exit(3)", 60, "agent_failed"), ("import time; time.sleep(30)", 1, "agent_timeout")],
)
def test_failing_or_hanging_agent_gives_an_untrained_sample(
    engine_server, tokenizer, tiny_model_dir, code, timeout, termination
):
    cfg = agent_config(
        tiny_model_dir, kind="external", command=[sys.executable, "-c", code], agent_timeout_s=timeout
    )
    samples, _ = run(_external(cfg, tokenizer, engine_server.url))
    for s in samples:
        assert s.termination == termination and s.status.value == "failed"
        assert s.loss_mask == [0] * s.response_length and s.response_length == 1


def shares(samples):
    """Advantage function of the multi-agent test: worker gets reward + 1, planner 10 * sample_id."""
    return [[float(s.reward) + 1.0, 10.0 * s.sample_id] for s in samples]


def test_multi_agent_sample_becomes_rows_with_the_users_values(engine_server, tokenizer, tiny_model_dir):
    cfg = agent_config(
        tiny_model_dir,
        kind="external",
        command=[sys.executable, str(AGENTS / "planner_worker.py")],
        contexts_per_sample=2,
        advantage_fn="tests.agentic.test_external_agent:shares",
        agent_timeout_s=120,
    )
    samples, _ = run(_external(cfg, tokenizer, engine_server.url))
    rows = samples_to_rows(samples, 2)
    assert len(samples) == 2 and len(rows) == 4
    for k, s in enumerate(samples):
        worker, planner = s, s.contexts[0]
        assert len(worker.turns) == 2 and len(planner.turns) == 1  # worker: two calls; planner: one
        assert "You work." in tokenizer.decode(worker.prompt_ids)
        assert "You plan." in tokenizer.decode(planner.prompt_ids)
        w_row, p_row = rows[2 * k], rows[2 * k + 1]
        assert w_row["reward"] == s.reward_info["outcome_reward"] + 1.0
        assert p_row["reward"] == 10.0 * s.sample_id
        assert (w_row["group_id"], p_row["group_id"]) == (0, 1)  # group 0, context slots 0 and 1
        assert p_row["response_ids"] == planner.response_ids and sum(p_row["loss_mask"]) > 0
        assert w_row["prompt_ids"] != p_row["prompt_ids"]


def _calc_schema():
    return {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    }
