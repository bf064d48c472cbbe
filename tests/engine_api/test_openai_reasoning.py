"""Reasoning models on the embedded engine's `/v1/chat/completions`: `chat_template_kwargs` and
`reasoning_effort` reach the chat template, `continue_final_message` leaves the last assistant message
open, and with `--reasoning-parser` replies carry `reasoning_content` apart from `content` (whole and
streamed). The tiny model's template is given Qwen3's `enable_thinking` switch; the model is made to
write a `<think>` block by a grammar (its weights are random)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from relax.backends.inference.embedded.http.openai_backend import EngineOpenAIBackend
from relax.backends.inference.embedded.http.server import EngineServer, build_app
from relax.engine_api.openai.convert import tag_term
from relax.engine_api.openai.messages import TemplateOptions
from tests.engine_helpers import engine_process
from tests.thinking_template import EMPTY_BLOCK, THINKING_TEMPLATE

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def thinking_model_dir(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_thinking")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(thinking_model_dir):
    srv = EngineServer(
        str(thinking_model_dir), port=0, seed=0, max_running=8, dtype="float32", reasoning_parser="qwen3"
    )
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _think_grammar(tok, reasoning: str, answer: str, open_tag: bool = True) -> str:
    """A grammar that makes the model write `<think>reasoning</think>answer` (the tags are added tokens)."""
    opening = f"{tag_term(tok, '<think>')} " if open_tag else ""
    return f"start: {opening}{json.dumps(reasoning)} {tag_term(tok, '</think>')} {json.dumps(answer)}\n"


def _prompt_ids(server, messages, **options) -> list[int]:
    backend = EngineOpenAIBackend(server.engine)
    return asyncio.run(backend.chat_prompt(messages, None, TemplateOptions(**options))).prompt_ids


def test_chat_template_kwargs_render_the_prompt(server):
    tok = server.engine.tokenizer
    plain = _prompt_ids(server, MESSAGES)
    no_think = _prompt_ids(server, MESSAGES, kwargs={"enable_thinking": False})
    # the same prompt, with the empty think block after the opened assistant turn
    assert no_think == plain + tok.encode(EMPTY_BLOCK, add_special_tokens=False)
    effort = _prompt_ids(server, MESSAGES, kwargs={"reasoning_effort": "low"})
    assert effort == plain + tok.encode("effort: low\n", add_special_tokens=False)


def test_chat_template_kwargs_over_http(server, oai):
    tok = server.engine.tokenizer
    usage = {}
    for name, extra in [
        ("plain", {}),
        ("no_think", {"chat_template_kwargs": {"enable_thinking": False}}),
        ("effort", {"reasoning_effort": "high"}),
    ]:
        reply = oai.chat.completions.create(
            model=server.engine.runner.model_path,
            messages=MESSAGES,
            max_tokens=1,
            temperature=0,
            extra_body=extra,
        )
        usage[name] = reply.usage.prompt_tokens
    assert usage["no_think"] == usage["plain"] + len(tok.encode(EMPTY_BLOCK, add_special_tokens=False))
    assert usage["effort"] == usage["plain"] + len(tok.encode("effort: high\n", add_special_tokens=False))
    bad = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": MESSAGES, "chat_template_kwargs": {"add_generation_prompt": False}},
        timeout=30,
    )
    assert bad.status_code == 400 and "add_generation_prompt" in bad.json()["error"]["message"]


def test_continue_final_message(server, oai):
    tok = server.engine.tokenizer
    start = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    continued = _prompt_ids(server, start, add_generation_prompt=False, continue_final_message=True)
    closed = _prompt_ids(server, start, add_generation_prompt=False)
    head = _prompt_ids(server, MESSAGES)  # through the opened assistant turn
    assert continued == head + tok.encode("The answer is", add_special_tokens=False)
    assert closed[: len(continued)] == continued and closed != continued  # that one ends the turn
    reply = oai.chat.completions.create(
        model=server.engine.runner.model_path,
        messages=start,
        max_tokens=1,
        extra_body={"continue_final_message": True},
    )
    assert reply.usage.prompt_tokens == len(continued)
    reply = oai.chat.completions.create(
        model=server.engine.runner.model_path,
        messages=start,
        max_tokens=1,
        extra_body={"add_generation_prompt": False},
    )
    assert reply.usage.prompt_tokens == len(closed)
    for body, field in [
        ({"messages": MESSAGES, "continue_final_message": True}, "messages"),  # no assistant message last
        ({"messages": start, "continue_final_message": True, "add_generation_prompt": True}, "continue"),
    ]:
        bad = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        assert (
            bad.status_code == 400 and field in bad.json()["error"]["message"] + bad.json()["error"]["param"]
        )


def test_reasoning_content_split(server, oai):
    grammar = _think_grammar(server.engine.tokenizer, "two and two", "4")
    reply = oai.chat.completions.create(
        model=server.engine.runner.model_path, messages=MESSAGES, max_tokens=40, extra_body={"ebnf": grammar}
    )
    message = reply.choices[0].message.model_dump()
    assert message["reasoning_content"] == "two and two" and message["content"] == "4"
    # the request turns the parser off: the text as written
    reply = oai.chat.completions.create(
        model=server.engine.runner.model_path,
        messages=MESSAGES,
        max_tokens=40,
        extra_body={"ebnf": grammar, "separate_reasoning": False},
    )
    message = reply.choices[0].message.model_dump()
    assert message["content"] == "<think>two and two</think>4" and message.get("reasoning_content") is None


def test_reasoning_content_streamed(server, oai):
    grammar = _think_grammar(server.engine.tokenizer, "two and two", "4")
    stream = oai.chat.completions.create(
        model=server.engine.runner.model_path,
        messages=MESSAGES,
        max_tokens=40,
        stream=True,
        extra_body={"ebnf": grammar},
    )
    reasoning, content, order = "", "", []
    for chunk in stream:
        delta = chunk.choices[0].delta.model_dump()
        if delta.get("reasoning_content"):
            reasoning += delta["reasoning_content"]
            order.append("reasoning")
        if delta.get("content"):
            content += delta["content"]
            order.append("content")
    assert reasoning == "two and two" and content == "4"
    assert order.index("content") > max(i for i, kind in enumerate(order) if kind == "reasoning")
    assert order.count("reasoning") > 1  # streamed token by token, not sent at the end


def test_deepseek_r1_style_from_the_command_line(thinking_model_dir, server):
    """`relax engine serve --reasoning-parser deepseek-r1`: R1's template opens the block in the prompt, so
    the output has only `</think>`; the split is the same whole and streamed."""
    proc, url = engine_process(thinking_model_dir, "--threads", "1", "--reasoning-parser", "deepseek-r1")
    try:
        grammar = _think_grammar(server.engine.tokenizer, "two and two", "4", open_tag=False)
        body = {"messages": MESSAGES, "max_tokens": 40, "ebnf": grammar}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        message = reply["choices"][0]["message"]
        assert message["reasoning_content"] == "two and two" and message["content"] == "4"
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "two and two"
        assert "".join(d.get("content") or "" for d in deltas) == "4"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unknown_reasoning_parser_is_refused(server):
    with pytest.raises(ValueError, match="deepseek-r1, qwen3"):
        build_app(server.engine, reasoning_parser="qwen")


def test_tool_calls_are_parsed_from_the_answer_only(server, oai):
    """A call after the reasoning is a tool call; the reasoning is not content, whole or streamed."""
    tok = server.engine.tokenizer
    call = '\n{"name": "calc", "arguments": {}}\n'
    grammar = (
        f"start: {tag_term(tok, '<think>')} {json.dumps('plan')} {tag_term(tok, '</think>')} "
        f"{tag_term(tok, '<tool_call>')} {json.dumps(call)} {tag_term(tok, '</tool_call>')}\n"
    )
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    kwargs = {
        "model": server.engine.runner.model_path,
        "messages": MESSAGES,
        "tools": tools,
        "max_tokens": 40,
        "extra_body": {"ebnf": grammar},
    }
    reply = oai.chat.completions.create(**kwargs)
    message = reply.choices[0].message.model_dump()
    assert message["reasoning_content"] == "plan" and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["calc"]
    assert reply.choices[0].finish_reason == "tool_calls"
    chunks = list(oai.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "plan"
    assert not "".join(d.get("content") or "" for d in deltas)
    assert [t["function"]["name"] for d in deltas for t in d.get("tool_calls") or []] == ["calc"]
