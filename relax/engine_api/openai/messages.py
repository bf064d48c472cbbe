"""OpenAI chat messages in the shape a Hugging Face chat template reads: text content (content parts
joined), tool-call arguments as objects."""

from __future__ import annotations

import json
from typing import Any

from relax.engine_api.openai.errors import OpenAIError


def text_of(content: Any) -> str:
    """A message's text; content parts must be text (`{"type": "text", "text": ...}`)."""
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type", "text") not in ("text", "input_text"):
                raise OpenAIError(
                    f"content parts of type {p.get('type')!r} are not supported; send text", 400, "messages"
                )
            parts.append(str(p.get("text", "")) if isinstance(p, dict) else str(p))
        return "".join(parts)
    return "" if content is None else str(content)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI request messages in the shape the chat template reads (text content, argument dicts)."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise OpenAIError("every message needs a role", 400, "messages")
        msg: dict[str, Any] = {"role": m["role"], "content": text_of(m.get("content"))}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c.get("function", c)
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except json.JSONDecodeError:
                        pass
                calls.append({"name": fn.get("name"), "arguments": args})
            msg["tool_calls"] = calls
        out.append(msg)
    return out
