"""Streaming helpers shared by the engine's SGLang stream and the OpenAI streams: server-sent events, and
the text of a growing list of tokens released only once it is stable.

Text is held back while it ends in an incomplete UTF-8 character (decoded as U+FFFD) or in a tail that
could still become a stop string (the request ends before a stop string and the string is not returned),
so that what a client has received is always a prefix of the final text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any


def sse(data: Any) -> str:
    """One server-sent event holding `data` as JSON (`[DONE]` as it is)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


DONE = sse("[DONE]")


class IncrementalText:
    """The decoded text of tokens added one batch at a time; `add` returns what became stable."""

    def __init__(
        self, tokenizer: Any, skip_special_tokens: bool = True, stop: list[str] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.hold = max((len(s) for s in stop or []), default=1) - 1  # chars a stop string could still need
        self.ids: list[int] = []
        self.sent = ""  # text released so far

    def text(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.text()
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        stable = text[: max(len(text) - self.hold, len(self.sent))]
        delta, self.sent = stable[len(self.sent) :], stable
        return delta

    def finish(self, final_text: str) -> str:
        """The rest, given the request's final text (cut before a matched stop string)."""
        delta = final_text[len(self.sent) :] if final_text.startswith(self.sent) else ""
        self.sent = final_text
        return delta


async def drain_until(queue: asyncio.Queue, done: asyncio.Future) -> AsyncIterator[list[Any]]:
    """The items put on `queue` (by callbacks, from any thread through `call_soon_threadsafe`), a batch
    at a time as they come, until `done` has finished and the queue is empty. Items put before `done`
    finished (from the same thread) are all yielded: they were queued first."""
    while True:
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, done}, return_when=asyncio.FIRST_COMPLETED)
        items = [getter.result()] if getter.done() else []
        if not getter.done():
            getter.cancel()  # an item it was about to take stays in the queue
        while not queue.empty():
            items.append(queue.get_nowait())
        if items:
            yield items
        if done.done() and queue.empty():
            return
