"""Checks of an OpenAI-compatible server made with the official `openai` client, the way users call it.
The same checks run against an embedded engine's `/v1` (tests/engine_api/test_openai_engine.py) and
against the agent endpoint from inside a training run (tests/agentic/agents/openai_agent.py), so both
serve the same API. Each check raises AssertionError naming what differs; `run_all` returns their names.

The model is a random tiny one: checks fix what must hold whatever it says (greedy determinism, stop
strings, constrained output, shapes), and pass `ignore_eos` (an extension both servers serve) where a
check needs some text.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai

TOOLS = [
    {"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
     "parameters": {"type": "object", "properties": {"expr": {"type": "string", "maxLength": 12}},
                    "required": ["expr"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
     "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}},
                    "required": ["word"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "What is 3+4?"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def check_models(client: openai.OpenAI, model: str) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [model], ids
    assert client.models.retrieve(model).id == model
    try:
        client.models.retrieve("no-such-model")
    except openai.NotFoundError:
        pass
    else:
        raise AssertionError("an unknown model id must be a 404")


def check_chat_and_usage(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=5, **GREEDY)
    (c,) = r.choices
    assert c.message.role == "assistant" and c.finish_reason == "length", c
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    again = client.chat.completions.create(model=model, messages=USER, max_completion_tokens=5, **GREEDY)
    assert again.choices[0].message.content == c.message.content  # max_completion_tokens, greedy


def check_stop(client: openai.OpenAI, model: str) -> None:
    free = client.chat.completions.create(model=model, messages=USER, max_tokens=12, **GREEDY)
    text = free.choices[0].message.content
    assert len(text) >= 4, repr(text)
    stop = text[2:4]
    r = client.chat.completions.create(model=model, messages=USER, max_tokens=12, stop=[stop], **GREEDY)
    assert r.choices[0].message.content == text[: text.index(stop)], (
        text,
        stop,
        r.choices[0].message.content,
    )
    assert r.choices[0].finish_reason == "stop"


def check_seed(client: openai.OpenAI, model: str) -> None:
    a, b = (
        client.chat.completions.create(
            model=model,
            messages=USER,
            max_tokens=8,
            temperature=1.0,
            seed=1234,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        for _ in range(2)
    )
    assert a.choices[0].message.content == b.choices[0].message.content


def check_n(client: openai.OpenAI, model: str, max_n: int | None) -> None:
    try:
        r = client.chat.completions.create(model=model, messages=USER, max_tokens=3, n=3, temperature=1.0)
    except openai.BadRequestError as e:
        assert max_n is not None and "n" in str(e), e
        return
    assert max_n is None and [c.index for c in r.choices] == [0, 1, 2]


def check_logprobs(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=USER, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2
        assert (
            t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4
        )  # greedy


def check_streaming(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=USER, max_tokens=8, **GREEDY)
    chunks = list(client.chat.completions.create(model=model, messages=USER, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))  # fmt: skip
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content
    # Content comes as tokens are sampled, at most one piece a token; a busy host may merge tokens its
    # writer had not yet sent into one piece (as SGLang's stream does), so "at least two pieces" would
    # depend on timing (tests/engine_api/test_sglang_protocol.py checks the engine's chunks grow).
    assert 1 <= len(pieces) <= 8, pieces
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]


def _args(call: Any) -> dict:
    return json.loads(call.function.arguments)


def check_tools(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice="required",
                                       max_tokens=64, temperature=1.0, seed=3)  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None, c
    names = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(_args(call), names[call.function.name])
    named = client.chat.completions.create(
        model=model, messages=USER, tools=TOOLS, max_tokens=64, temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
    )  # fmt: skip
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "lookup" and set(_args(call)) == {"word"}
    # the reply goes back as history: a tool result, then the next call
    history = [*USER, named.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "a word"}]  # fmt: skip
    none = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=6
    )
    assert not none.choices[0].message.tool_calls


def check_stream_tool_calls(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.chat.completions.create(model=model, messages=USER, tools=TOOLS, tool_choice="required",
                                                 max_tokens=64, temperature=1.0, seed=5, stream=True))  # fmt: skip
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert calls and all(t.function.name in ("calc", "lookup") for t in calls)
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


def check_response_format(client: openai.OpenAI, model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    r = client.chat.completions.create(
        model=model, messages=USER, response_format=fmt, max_tokens=64, temperature=1.0
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    # any JSON object: unbounded, so a random model may run out of tokens inside it; what it wrote is
    # then the start of one, and a finished one parses
    obj = client.chat.completions.create(model=model, messages=USER, response_format={"type": "json_object"},
                                         max_tokens=48, temperature=0.7, seed=2)  # fmt: skip
    c = obj.choices[0]
    assert c.message.content.startswith("{")
    assert c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict)


def check_completions(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, logprobs=2, **GREEDY)
    (c,) = r.choices
    assert c.finish_reason == "length" and r.usage.completion_tokens == 6
    assert len(c.logprobs.tokens) == 6 and len(c.logprobs.token_logprobs) == 6
    assert all(len(t) <= 2 for t in c.logprobs.top_logprobs) and "".join(c.logprobs.tokens) == c.text
    stream = list(
        client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, stream=True, **GREEDY)
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == c.text


def check_errors(client: openai.OpenAI, model: str) -> None:
    for kwargs, needle in [
        ({"extra_body": {"bogus_param": 1}}, "bogus_param"),
        ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
        ({"temperature": -1}, "temperature"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]:
        try:
            client.chat.completions.create(model=model, messages=USER, max_tokens=2, **kwargs)
        except openai.BadRequestError as e:
            assert needle in str(e) and e.body and e.body.get("message"), e
        else:
            raise AssertionError(f"{kwargs} must be refused")


def run_all(client: openai.OpenAI, model: str, max_n: int | None = None) -> list[str]:
    checks = [
        lambda: check_models(client, model), lambda: check_chat_and_usage(client, model),
        lambda: check_stop(client, model), lambda: check_seed(client, model),
        lambda: check_n(client, model, max_n), lambda: check_logprobs(client, model),
        lambda: check_streaming(client, model), lambda: check_tools(client, model),
        lambda: check_stream_tool_calls(client, model), lambda: check_response_format(client, model),
        lambda: check_completions(client, model), lambda: check_errors(client, model),
    ]  # fmt: skip
    names = ["models", "chat", "stop", "seed", "n", "logprobs", "streaming", "tools", "stream_tool_calls",
             "response_format", "completions", "errors"]  # fmt: skip
    for check in checks:
        check()
    return names
