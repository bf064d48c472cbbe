"""Reasoning parsers: a reasoning model's `<think>...</think>` block split from its answer.

Two styles, named as SGLang names them (`relax engine serve --reasoning-parser NAME`):

* `qwen3`: the model opens the block itself. Reasoning is the text between a leading `<think>` and
  `</think>`; an output that does not start with `<think>` (whitespace aside) is all answer, as with
  Qwen3's `enable_thinking: false`, whose template writes an empty block into the prompt.
* `deepseek-r1`: the template ends the prompt with `<think>`, so the output starts inside the
  reasoning and only writes `</think>`. Everything up to `</think>` is reasoning (a leading `<think>`,
  which older R1 templates leave to the model, is dropped); an output that never closes the block is
  all reasoning.

The reasoning is given stripped of surrounding whitespace, the answer without the whitespace that
follows `</think>`. `split_reasoning` parses a whole output; `ReasoningSplitter` does the same on the
text as it streams, so that the concatenated deltas equal the whole-output split for any chunking (tags
split across chunks included). `strip_reasoning` gives the answer of any output, either style, for
rewards.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ReasoningStyle:
    name: str
    starts_inside: bool  # the prompt opened the block: the output begins inside the reasoning


REASONING_PARSERS: dict[str, ReasoningStyle] = {
    "qwen3": ReasoningStyle("qwen3", starts_inside=False),
    "deepseek-r1": ReasoningStyle("deepseek-r1", starts_inside=True),
}


def reasoning_style(name: str) -> ReasoningStyle:
    """The parser called `name`; an unknown name raises `ValueError` listing the known ones."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


def split_reasoning(text: str, style: ReasoningStyle) -> tuple[str | None, str]:
    """(reasoning or None when the output has no reasoning block, answer) of a whole output."""
    head = text.lstrip()
    if head.startswith(THINK_OPEN):
        body = head[len(THINK_OPEN) :]
    elif style.starts_inside:
        body = text
    else:
        return None, text
    reasoning, closed, answer = body.partition(THINK_CLOSE)
    return reasoning.strip(), answer.lstrip() if closed else ""


def strip_reasoning(text: str) -> str:
    """The answer of an output of either style: the text after the first `</think>`; "" for an output
    that opens a block and never closes it (no answer was written); the text itself otherwise."""
    if THINK_CLOSE in text:
        return text.partition(THINK_CLOSE)[2].lstrip()
    return "" if text.lstrip().startswith(THINK_OPEN) else text


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    return next((k for k in range(len(tag) - 1, 0, -1) if text.endswith(tag[:k])), 0)


class ReasoningSplitter:
    """`split_reasoning` on streamed text: `add(delta)` gives the (reasoning, answer) text to send now,
    `finish()` what was held back. Text that may still become a tag, and whitespace that may turn out to
    be the reasoning's end, is held until a later delta decides it."""

    def __init__(self, style: ReasoningStyle) -> None:
        self.style = style
        self.state = "start"  # start (before the block is known) | reasoning | answer
        self.buffer = ""  # received, not yet released
        self.reasoning_started = False  # a reasoning character was released (leading whitespace dropped)
        self.answer_started = False  # an answer character was released (after </think>: whitespace dropped)

    def add(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(THINK_OPEN):
                self.state, self.buffer = "reasoning", head[len(THINK_OPEN) :]
            elif THINK_OPEN.startswith(head):
                return "", ""  # still possibly the opening tag (or only whitespace so far)
            elif self.style.starts_inside:
                self.state = "reasoning"
            else:  # no block: all answer, as written
                self.state, self.answer_started = "answer", True
        reasoning = ""
        if self.state == "reasoning":
            at = self.buffer.find(THINK_CLOSE)
            if at < 0:
                body = self.buffer[: len(self.buffer) - _partial_tail(self.buffer, THINK_CLOSE)]
                ready = body.rstrip()  # trailing whitespace may end the reasoning: hold it
                self.buffer = self.buffer[len(ready) :]
                return self._reasoning(ready), ""
            reasoning = self._reasoning(self.buffer[:at].rstrip())
            self.state, self.buffer = "answer", self.buffer[at + len(THINK_CLOSE) :]
        if not self.answer_started:
            self.buffer = self.buffer.lstrip()
            self.answer_started = bool(self.buffer)
        answer, self.buffer = self.buffer, ""
        return reasoning, answer

    def _reasoning(self, text: str) -> str:
        if not self.reasoning_started:
            text = text.lstrip()
            self.reasoning_started = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """What is still held once the output ended."""
        rest, self.buffer = self.buffer, ""
        if self.state == "start":  # only whitespace, or the start of "<think>", was written
            return (rest.strip(), "") if self.style.starts_inside else ("", rest)
        if self.state == "reasoning":  # never closed: a held partial tag is reasoning after all
            return self._reasoning(rest.rstrip()), ""
        return "", ""  # whitespace after </think> only
