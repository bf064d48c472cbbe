"""Tool calls in a model turn, in the chat template's format (Qwen2.5 / Hermes style)::

    <tool_call>
    {"name": "calc", "arguments": {"expr": "37*8"}}
    </tool_call>

A turn may hold several calls; the text outside them is the turn's content. `arguments` may also be a
JSON string holding the object (as OpenAI clients send it).

The compact form: an environment with one main tool may accept `<tool_call>37*8</tool_call>`, a body
that is not a JSON call, as that tool's single string argument (`compact_tool=("calc", "expr")`). It
keeps the call short enough for a tiny model trained from scratch to discover; real models use JSON.

A call that cannot be parsed (bad JSON, no name, no closing tag) is kept as a `ToolCall` with `error`
set, so the environment answers it with an error observation instead of ignoring it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S)


@dataclass
class ToolCall:
    name: str  # "" when the call could not be parsed
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""  # the text between the tags
    error: str = ""  # why it could not be parsed ("" = well formed)
    id: str = ""  # call id (OpenAI tool_call_id), filled by whoever needs one
    text: str = ""  # the call as the model wrote it: its tags, and no closing tag when it wrote none

    @property
    def ok(self) -> bool:
        return not self.error

    def to_openai(self) -> dict[str, Any]:
        """The call in an OpenAI chat message's `tool_calls` list."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


@dataclass
class ParsedTurn:
    content: str  # the turn's text without its tool calls (stripped)
    tool_calls: list[ToolCall]


def _parse_body(body: str, compact_tool: tuple[str, str] | None) -> ToolCall:
    text = body.replace("<|im_end|>", "").replace("<|endoftext|>", "").strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if compact_tool is not None and text:
            name, arg = compact_tool
            return ToolCall(name, {arg: text}, raw=body)
        return ToolCall("", raw=body, error=f"tool call is not valid JSON ({e.msg})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        if compact_tool is not None and text:
            name, arg = compact_tool
            return ToolCall(name, {arg: text}, raw=body)
        return ToolCall("", raw=body, error='tool call needs {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(obj["name"], raw=body, error=f"arguments string is not valid JSON ({e.msg})")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], raw=body, error="arguments must be a JSON object")
    return ToolCall(obj["name"], args, raw=body)


def parse_tool_calls(text: str, compact_tool: tuple[str, str] | None = None) -> ParsedTurn:
    """The content and tool calls of one model turn's text (special tokens kept in `text`)."""
    calls = []
    for m in _CALL_RE.finditer(text):
        call = _parse_body(m.group(1), compact_tool)
        call.text = m.group(0)
        if not m.group(2) and not call.error:
            call.error = f"tool call is not closed with {TOOL_CALL_CLOSE}"
        calls.append(call)
    content = _CALL_RE.sub("", text)
    for marker in ("<|im_end|>", "<|endoftext|>"):
        content = content.replace(marker, "")
    return ParsedTurn(content.strip(), calls)


def cut_call(text: str) -> bool:
    """Whether the text ends inside a tool call (opened, never closed): a turn cut by its token limit."""
    return any(not c.text.endswith(TOOL_CALL_CLOSE) for c in parse_tool_calls(text).tool_calls)
