"""Tool calls parsed from a turn in the chat template's format, and tool calls that fail in every way."""

from __future__ import annotations

import asyncio
import json

import pytest
from agentic_helpers import run

from relax.agentic.parser import parse_tool_calls
from relax.agentic.tools import Tool, ToolOutput, call_tool

SCHEMA = {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}


def test_qwen_json_calls_and_content():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calc", "arguments": {"expr": "37*8"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "calc", "arguments": "{\\"expr\\": \\"1+1\\"}"}\n</tool_call><|im_end|>'
    )
    turn = parse_tool_calls(text)
    assert turn.content == "Let me compute."
    assert [(c.name, c.arguments, c.ok) for c in turn.tool_calls] == [
        ("calc", {"expr": "37*8"}, True),
        ("calc", {"expr": "1+1"}, True),  # arguments given as a JSON string (OpenAI style)
    ]


def test_malformed_calls_are_kept_with_an_error():
    bad_json = parse_tool_calls("<tool_call>{name: calc}</tool_call>").tool_calls[0]
    assert not bad_json.ok and "not valid JSON" in bad_json.error
    no_name = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>').tool_calls[0]
    assert "name" in no_name.error
    unclosed = parse_tool_calls('<tool_call>{"name": "calc", "arguments": {}}<|im_end|>').tool_calls[0]
    assert "not closed" in unclosed.error
    assert parse_tool_calls("just an answer: 296<|im_end|>").tool_calls == []


def test_compact_calls_go_to_the_default_tool():
    turn = parse_tool_calls("<tool_call>37*8</tool_call>", compact_tool=("calc", "expr"))
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("calc", {"expr": "37*8"})]
    json_call = parse_tool_calls(
        '<tool_call>{"name": "other", "arguments": {}}</tool_call>', ("calc", "expr")
    )
    assert json_call.tool_calls[0].name == "other"  # JSON calls still name their tool
    assert not parse_tool_calls("<tool_call></tool_call>", ("calc", "expr")).tool_calls[0].ok


def test_parse_round_trips_through_the_tiny_tokenizer(tokenizer):
    msg = [
        {"role": "user", "content": "3*4?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "calc", "arguments": {"expr": "3*4"}}]},
    ]
    text = tokenizer.apply_chat_template(msg, tokenize=False)
    ids = tokenizer.encode(text.split("<|im_start|>assistant\n")[-1], add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in ids  # one token, as in Qwen's vocabulary
    calls = parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=False)).tool_calls
    assert [(c.name, c.arguments) for c in calls] == [("calc", {"expr": "3*4"})]


def _tools():
    async def slow(expr: str) -> str:
        await asyncio.sleep(10)
        return expr

    def boom(expr: str) -> str:
        raise ZeroDivisionError("division by zero")

    def picture(expr: str) -> ToolOutput:
        return ToolOutput("see", images=["img"])

    return {
        t.name: t
        for t in [
            Tool("calc", "", SCHEMA, lambda expr: {"value": len(expr)}),
            Tool("slow", "", SCHEMA, slow),
            Tool("boom", "", SCHEMA, boom),
            Tool("picture", "", SCHEMA, picture),
        ]
    }


@pytest.mark.parametrize(
    ("name", "args", "ok", "error", "text"),
    [
        ("calc", {"expr": "ab"}, True, "", json.dumps({"value": 2})),
        (
            "nope",
            {"expr": "x"},
            False,
            "unknown_tool",
            "Error: unknown tool 'nope'; available tools: boom, calc, picture, slow",
        ),
        (
            "calc",
            {"expr": 3},
            False,
            "bad_arguments",
            "Error: bad arguments for calc: 3 is not of type 'string'",
        ),
        ("calc", {}, False, "bad_arguments", "Error: bad arguments for calc: 'expr' is a required property"),
        ("boom", {"expr": "1/0"}, False, "exception", "Error: ZeroDivisionError: division by zero"),
        ("slow", {"expr": "x"}, False, "timeout", "Error: slow timed out after 0.2s"),
    ],
)
def test_call_tool_outcomes(name, args, ok, error, text):
    r = run(call_tool(_tools(), name, args, timeout_s=0.2))
    assert (r.ok, r.error, r.text) == (ok, error, text)


def test_tool_output_carries_images():
    r = run(call_tool(_tools(), "picture", {"expr": ""}, timeout_s=1))
    assert r.ok and r.text == "see" and r.images == ["img"]
