"""OpenAI response bodies: assistant messages (content and Qwen-format tool calls, `content: null` beside
tool calls; `reasoning_content` split from the content when the server has a reasoning parser and the
request's `separate_reasoning` is on), finish reasons, log-probs in chat and legacy shapes, usage."""

from __future__ import annotations

from typing import Any

from relax.data.reasoning import ReasoningStyle, reasoning_style, split_reasoning
from relax.engine_api.openai.backend import ChatPrompt, Choice, OpenAIBackend
from relax.engine_api.openai.tool_calls import cut_call, parse_tool_calls


def reasoning_of(backend: OpenAIBackend, separate_reasoning: bool) -> ReasoningStyle | None:
    """The reasoning parser a chat request's reply goes through: the server's (`reasoning_parser` of the
    backend, None when it has none), unless the request turns it off."""
    name = getattr(backend, "reasoning_parser", None)
    return reasoning_style(name) if name and separate_reasoning else None


def assistant_message(
    text: str,
    parse_tools: bool,
    backend: OpenAIBackend,
    prompt: ChatPrompt,
    reasoning: ReasoningStyle | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(message, its tool calls). A call that cannot be parsed stays in the content as the model wrote it.
    With a reasoning parser, the reasoning is `reasoning_content` (None when the output has no block)
    and tool calls are parsed from the answer only."""
    thought: dict[str, Any] = {}
    if reasoning is not None:
        r, text = split_reasoning(text, reasoning)
        thought = {"reasoning_content": r}
    if not parse_tools:
        return {"role": "assistant", "content": text, **thought}, []
    parsed = parse_tool_calls(text)
    content, calls = parsed.content, []
    for c in parsed.tool_calls:
        if c.ok:
            c.id = backend.tool_call_id(prompt, len(calls))
            calls.append(c.to_openai())
        else:
            content = (content + "\n" + c.text).strip()  # as written: a call cut short stays open
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content if content or not calls else None,
        **thought,
    }
    if calls:
        message["tool_calls"] = calls
    return message, calls


def finish_reason(choice: Choice, calls: list[Any]) -> str:
    """OpenAI's finish reason: `tool_calls` for a turn with calls, unless the tokens ran out inside a call
    (`length`: that call is cut, and stays in the content as written); `abort` for a generation the
    engine ended (never reported as a natural `stop`)."""
    if choice.finish_reason == "abort":
        return "abort"
    if calls and not (choice.finish_reason == "length" and cut_call(choice.text)):
        return "tool_calls"
    return "length" if choice.finish_reason == "length" else "stop"


def _token(tokenizer: Any, t: int) -> str:
    return tokenizer.decode([t]) if tokenizer is not None else str(t)


def chat_logprobs(ids: list[int], lps: list[float], tops: list[Any], tokenizer: Any, top_n: int) -> dict:
    """`choices[i].logprobs` of a chat completion (or its chunk's share of tokens)."""
    content = []
    for k, (t, lp) in enumerate(zip(ids, lps, strict=True)):
        tok = _token(tokenizer, t)
        top = tops[k] if k < len(tops) and tops[k] else []
        content.append({
            "token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [
                {"token": (s := _token(tokenizer, i)), "logprob": v, "bytes": list(s.encode("utf-8"))}
                for v, i in top[:top_n]
            ],
        })  # fmt: skip
    return {"content": content}


def completion_logprobs(
    ids: list[int], lps: list[float], tops: list[Any], tokenizer: Any, offset: int = 0
) -> dict:
    """`choices[i].logprobs` of a legacy completion: tokens, their log-probs, top log-probs, text offsets."""
    tokens = [_token(tokenizer, t) for t in ids]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = [
        {_token(tokenizer, i): v for v, i in (tops[k] if k < len(tops) and tops[k] else [])}
        for k in range(len(ids))
    ]
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.output_ids) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
