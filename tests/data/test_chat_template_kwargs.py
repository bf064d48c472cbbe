"""`data.chat_template_kwargs`: training prompts are rendered with the template's own variables (Qwen3's
`enable_thinking`) wherever Relax applies the chat template: the rollout's prompt tokens, the
prompt-length check before the run, and agent turns (prompt and the assistant turns opened after tool
results)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from relax.agentic.env import Message
from relax.agentic.turns import TurnFormatter
from relax.data.config import DataConfig
from relax.data.dataset import PromptRow, tokenize_prompt
from relax.data.overlong import find_overlong
from relax.models.tokenizer import train_tiny_tokenizer
from tests.thinking_template import EMPTY_BLOCK, THINKING_TEMPLATE

NO_THINK = {"enable_thinking": False}


@pytest.fixture(scope="module")
def tok():
    tok = train_tiny_tokenizer(512)
    tok.chat_template = THINKING_TEMPLATE
    return tok


def _block(tok) -> list[int]:
    return tok.encode(EMPTY_BLOCK, add_special_tokens=False)


def test_config_key_is_declared_and_checked():
    assert DataConfig(train_files=["a.jsonl"]).chat_template_kwargs == {}
    cfg = DataConfig(train_files=["a.jsonl"], chat_template_kwargs=NO_THINK)
    assert cfg.chat_template_kwargs == NO_THINK
    with pytest.raises(ValidationError, match="data.chat_template_kwargs may not set add_generation_prompt"):
        DataConfig(train_files=["a.jsonl"], chat_template_kwargs={"add_generation_prompt": False})
    assert "enable_thinking" in DataConfig.model_fields["chat_template_kwargs"].description


def test_prompt_tokens_follow_the_template_kwargs(tok):
    plain = tokenize_prompt(tok, "3+4=")
    no_think = tokenize_prompt(tok, "3+4=", template_kwargs=NO_THINK)
    assert no_think == plain + _block(tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4="}]
    assert tokenize_prompt(tok, messages, template_kwargs=NO_THINK) == tokenize_prompt(
        tok, messages
    ) + _block(tok)


def test_prompt_length_check_counts_the_rendered_prompt(tok):
    row = PromptRow(index=0, prompt="3+4=", label="7")
    plain = len(tokenize_prompt(tok, "3+4="))
    limit = plain + 1  # fits without the empty think block, not with it
    data = DataConfig(train_files=["a.jsonl"], max_prompt_len=limit)
    assert find_overlong([row], tok, data) == []
    data = DataConfig(train_files=["a.jsonl"], max_prompt_len=limit, chat_template_kwargs=NO_THINK)
    (found,) = find_overlong([row], tok, data)
    assert found.tokens == plain + len(_block(tok))


def test_agent_turns_follow_the_template_kwargs(tok):
    plain, no_think = TurnFormatter(tok), TurnFormatter(tok, template_kwargs=NO_THINK)
    assert no_think.prompt_ids("3+4=") == plain.prompt_ids("3+4=") + _block(tok)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    with_tools = plain.prompt_ids("3+4=", tools=tools)
    assert no_think.prompt_ids("3+4=", tools=tools) == with_tools + _block(tok)
    result = [Message(role="tool", content="7")]
    ids, _ = plain.observation(result, turn_ended=True)
    ids_no_think, _ = no_think.observation(result, turn_ended=True)
    assert ids_no_think == ids + _block(tok)  # the next assistant turn opens as the prompt's did
