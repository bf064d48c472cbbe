"""Token-by-token streaming of chat and legacy completions: each choice's text is released as the engine
samples it (`IncrementalText`: never a partial character or the start of a stop string). When tool calls
are parsed, text from the first `<tool_call>` on is held back and the calls are sent, whole, once the
choice ends (with content then `null`-safe: a choice that only calls tools streams no content). Parsed
content is stripped, so its leading and trailing whitespace is held back as well: the deltas add up to
exactly the message a non-streamed request gets. (They once did not: a reply streamed as " ab" whose
message was "ab" plus an incomplete character lost that character, and an agent that sent the streamed
reply back no longer matched its history.) With a reasoning parser, a chat choice's deltas carry
`reasoning_content` while the model is inside its `<think>` block and `content` after it
(`reasoning.ReasoningSplitter`)."""

from __future__ import annotations

from typing import Any

from relax.data.reasoning import ReasoningSplitter, ReasoningStyle
from relax.engine_api.openai.tool_calls import TOOL_CALL_OPEN
from relax.engine_api.streaming import IncrementalText


class ChoiceStream:
    """One choice's streamed content so far."""

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool,
        stop: list[str],
        parse_tools: bool,
        reasoning: ReasoningStyle | None = None,
    ) -> None:
        self.text = IncrementalText(tokenizer, skip_special_tokens, stop)
        self.parse_tools = parse_tools
        self.splitter = ReasoningSplitter(reasoning) if reasoning is not None else None
        self.sent_reasoning = ""  # reasoning_content sent
        self.pending = ""  # released by the engine text, not yet sent (a possible tool call's start)
        self.sent = ""  # content sent
        self.in_calls = False  # a tool call began: the rest is held for parsing
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[Any] = []
        self.started = False

    def add(self, ids: list[int], lps: list[float], tops: list[Any]) -> str:
        """New tokens; returns the content to send now."""
        return self._release(self._record(ids, lps, tops))

    def add_chat(self, ids: list[int], lps: list[float], tops: list[Any]) -> dict[str, str]:
        """New tokens of a chat choice; returns the delta to send now ({} when there is nothing)."""
        text = self._record(ids, lps, tops)
        reasoning, answer = self.splitter.add(text) if self.splitter is not None else ("", text)
        delta = {}
        if reasoning:
            self.sent_reasoning += reasoning
            delta["reasoning_content"] = reasoning
        content = self._release(answer)
        if content:
            delta["content"] = content
        return delta

    def _record(self, ids: list[int], lps: list[float], tops: list[Any]) -> str:
        self.ids += ids
        self.logprobs += lps
        self.tops += tops
        return self.text.add(ids)

    def finish_chat(self, message: dict[str, Any]) -> dict[str, str]:
        """The delta still to send given the choice's final message (after parsing)."""
        delta = {}
        final = message.get("reasoning_content") or ""
        rest = final[len(self.sent_reasoning) :] if final.startswith(self.sent_reasoning) else ""
        if rest:
            delta["reasoning_content"] = rest
        content = self.finish(message.get("content"))
        if content:
            delta["content"] = content
        return delta

    def _release(self, delta: str) -> str:
        if not self.parse_tools:
            self.sent += delta
            return delta
        if self.in_calls:
            return ""
        self.pending += delta
        if not self.sent:  # the parsed content is stripped: leading whitespace is never content
            self.pending = self.pending.lstrip()
        at = self.pending.find(TOOL_CALL_OPEN)
        if at >= 0:
            self.in_calls = True
            out, self.pending = self.pending[:at].rstrip(), ""
        else:  # keep a tail that may still grow into "<tool_call>"
            keep = next(
                (
                    k
                    for k in range(len(TOOL_CALL_OPEN) - 1, 0, -1)
                    if self.pending.endswith(TOOL_CALL_OPEN[:k])
                ),
                0,
            )
            body = self.pending[: len(self.pending) - keep]
            keep += len(body) - len(body.rstrip())  # trailing whitespace waits: it is stripped at the end
            out, self.pending = (
                self.pending[: len(self.pending) - keep],
                self.pending[len(self.pending) - keep :],
            )
        self.sent += out
        return out

    def finish(self, content: str | None) -> str:
        """The content still to send given the choice's final content (after parsing)."""
        final = content or ""
        rest = final[len(self.sent) :] if final.startswith(self.sent) else ""
        self.sent = final
        return rest
