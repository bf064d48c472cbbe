"""`ChatSession`: OpenAI-style chat calls of one sample's agent, generated token-in, token-out.

Each call's prompt extends the token sequence of the earlier call it continues (`SessionRecorder.
find_parent`): earlier tokens are reused as they were generated and only the new messages are encoded.
A call that continues nothing is rendered from its messages with the chat template (a new branch).
Every call is recorded, so the session's trajectories can be rebuilt (`SessionRecorder`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from relax.agentic.parser import parse_tool_calls
from relax.agentic.trajectory import CallRecord, SessionRecorder, normalize_message
from relax.agentic.turns import TurnFormatter

GenerateFn = Callable[[list[int], dict[str, Any]], Awaitable[Any]]  # -> one GenerateOutput


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI request messages in the shape the chat template reads (text content, argument dicts)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m["role"], "content": _text(m.get("content"))}
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


class ChatSession:
    def __init__(
        self,
        session_id: str,
        formatter: TurnFormatter,
        generate: GenerateFn,
        *,
        defaults: dict[str, Any],
        max_tokens_cap: int,
        stop_token_ids: list[int],
    ) -> None:
        self.session_id = session_id
        self.formatter = formatter
        self.tokenizer = formatter.tokenizer
        self._generate = generate
        self.defaults = defaults  # temperature, top_p, ... of the behaviour policy
        self.max_tokens_cap = max_tokens_cap
        self.stop_token_ids = list(stop_token_ids)
        self.recorder = SessionRecorder()
        self._lock = asyncio.Lock()  # calls are recorded in the order they are made

    def prompt_for(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None):
        """(prompt ids, parent call or None) for a request."""
        norm = [normalize_message(m) for m in messages]
        tools_key = json.dumps(tools or [], sort_keys=True)
        parent = self.recorder.find_parent(norm, tools_key)
        if parent is None:
            ids = self.formatter.prompt_ids(template_messages(messages), tools=tools or None)
            return ids, None, norm, tools_key
        rest = template_messages(messages[len(parent.messages) + 1 :])
        ended = bool(parent.output_ids) and parent.output_ids[-1] in self.stop_token_ids
        text = ("" if ended else self.formatter.eos_text) + self.formatter.messages_text(rest)
        ids = (
            parent.prompt_ids
            + parent.output_ids
            + list(self.tokenizer.encode(text, add_special_tokens=False))
        )
        return ids, parent, norm, tools_key

    async def chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
    ) -> tuple[dict[str, Any], str, dict[str, int]]:
        """One call: (assistant message in OpenAI shape, finish reason, usage)."""
        if not messages:
            raise ValueError("messages must hold at least one message")
        async with self._lock:
            prompt_ids, parent, norm, tools_key = self.prompt_for(messages, tools)
            index = len(self.recorder.calls)
        params = {
            **self.defaults,
            "n": 1,
            "max_new_tokens": min(int(max_tokens or self.max_tokens_cap), self.max_tokens_cap),
            "stop_token_ids": self.stop_token_ids,
        }
        if temperature is not None:
            params["temperature"] = float(temperature)
        if top_p is not None:
            params["top_p"] = float(top_p)
        out = await self._generate(prompt_ids, params)
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=False)
        parsed = parse_tool_calls(text)
        content = parsed.content
        calls = []
        for k, c in enumerate(parsed.tool_calls):
            if c.ok:
                c.id = f"call_{self.session_id}_{index}_{k}"
                calls.append(c.to_openai())
            else:
                content = (content + f"\n<tool_call>{c.raw}</tool_call>").strip()
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = calls
        finish = "tool_calls" if calls else ("length" if out.finish_reason == "length" else "stop")
        async with self._lock:
            self.recorder.add(
                CallRecord(
                    index=len(self.recorder.calls),
                    messages=norm,
                    tools_key=tools_key,
                    reply=normalize_message(reply),
                    prompt_ids=list(prompt_ids),
                    output_ids=list(out.output_ids),
                    log_probs=[float(x) for x in out.output_log_probs],
                    # the oldest weights of the call (a call updated in place spans two)
                    weight_version=int((out.weight_versions or [out.weight_version])[0]),
                    finish_reason=out.finish_reason,
                    parent=None if parent is None else parent.index,
                    reply_message=reply,
                )
            )
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(out.output_ids),
            "total_tokens": len(prompt_ids) + len(out.output_ids),
        }
        return reply, finish, usage
