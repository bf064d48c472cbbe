"""rollout.agent: validation with errors that say how to fix the config, environment lookup, and the
tools listed in a multi-turn prompt."""

from __future__ import annotations

import pytest
from agentic_helpers import agent_config
from pydantic import ValidationError

from relax.agentic.env import env_factory
from relax.agentic.multi_turn import MultiTurnRollout
from relax.data.dataset import PromptRow
from relax.rollout.partial_rollout import InflightRequests
from relax.rollout.router import Router


def test_config_errors_name_the_fix(tiny_model_dir):
    assert agent_config(tiny_model_dir).rollout.agent.kind == "single_turn"  # the default path
    with pytest.raises(ValidationError, match=r"rollout.agent.command=\[program"):
        agent_config(tiny_model_dir, kind="external")
    with pytest.raises(ValidationError, match="advantage_fn=package.module:fn"):
        agent_config(tiny_model_dir, contexts_per_sample=2)
    with pytest.raises(ValidationError, match="kind"):
        agent_config(tiny_model_dir, kind="multi_agent")
    cfg = agent_config(tiny_model_dir, contexts_per_sample=3, advantage_fn="m:f")
    assert cfg.rollout.rows_per_step == cfg.rollout.prompts_per_step * 2 * 3


def test_environment_lookup_errors():
    with pytest.raises(ValueError, match="built-ins: tools, calculator, search"):
        env_factory("calculater")
    with pytest.raises(ValueError, match="cannot import environment factory"):
        env_factory("no_such_module:make")


def test_multi_turn_prompt_lists_the_tools(tiny_model_dir, tokenizer):
    cfg = agent_config(tiny_model_dir, kind="multi_turn", env="calculator")
    mt = MultiTurnRollout(cfg, tokenizer, InflightRequests(Router([])), [tokenizer.eos_token_id])
    text = tokenizer.decode(mt.prompt_ids(PromptRow(0, "37*8?"), mt.make_env()))
    assert "# Tools" in text and '"name": "calc"' in text and text.endswith("<|im_start|>assistant\n")
    assert mt.stop_token_ids == sorted(
        {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("</tool_call>")}
    )
