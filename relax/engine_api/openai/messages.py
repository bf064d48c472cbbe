"""OpenAI chat messages in the shape a Hugging Face chat template reads: text content (content parts
joined), tool-call arguments as objects; and how a request renders them (`TemplateOptions`: Hugging
Face's `chat_template_kwargs` such as Qwen3's `enable_thinking`, `reasoning_effort`,
`add_generation_prompt`, `continue_final_message`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from relax.data.chat_template import check_template_kwargs
from relax.engine_api.openai.errors import OpenAIError
from relax.engine_api.openai.schema import ChatCompletionRequest


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


@dataclass
class TemplateOptions:
    """How a chat request's messages are rendered, beyond the messages and tools themselves."""

    kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables (enable_thinking, ...)
    add_generation_prompt: bool = True  # open the assistant's turn after the messages
    continue_final_message: bool = False  # leave the last (assistant) message open, to be continued

    @property
    def is_default(self) -> bool:
        return not self.kwargs and self.add_generation_prompt and not self.continue_final_message


def template_options(req: ChatCompletionRequest) -> TemplateOptions:
    """The options of a chat request. `reasoning_effort` becomes the template variable of that name (as
    OpenAI-compatible servers pass it) unless `chat_template_kwargs` sets it. `continue_final_message`
    needs an assistant message last and implies `add_generation_prompt: false` (given true: a 400)."""
    try:
        kwargs = check_template_kwargs(req.chat_template_kwargs, "chat_template_kwargs")
    except ValueError as e:
        raise OpenAIError(str(e), 400, "chat_template_kwargs") from e
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise OpenAIError(
                "continue_final_message continues the last message: it cannot be combined with "
                "add_generation_prompt=true (leave that out or set it false)",
                400,
                "continue_final_message",
            )
        if req.messages[-1].get("role") != "assistant":
            raise OpenAIError(
                "continue_final_message needs the last message to be the assistant's", 400, "messages"
            )
        return TemplateOptions(kwargs, add_generation_prompt=False, continue_final_message=True)
    return TemplateOptions(kwargs, add_generation_prompt=req.add_generation_prompt is not False)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    options: TemplateOptions | None = None,
) -> str:
    """The prompt text of a chat request, from the tokenizer's chat template."""
    options = options or TemplateOptions()
    return tokenizer.apply_chat_template(
        template_messages(messages),
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message,
        **options.kwargs,
    )
