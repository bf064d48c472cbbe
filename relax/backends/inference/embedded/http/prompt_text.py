"""Prompt text to token ids, at a cost bounded by the engine's context rather than by the text.

A request's text may be as long as the body limit allows (64 MiB). Tokenized whole, such a text costs
minutes of CPU on the server's thread and gigabytes that the allocator keeps, only to be refused because
its tokens cannot fit the context. Only about a context's worth of it ever needs tokenizing to know that.

`encode_prompt` tokenizes a text of at most `FAST_CHARS_PER_TOKEN` characters per token of the context
at once (such a text costs about what a full context costs). A longer text is first counted piece by
piece, each piece cut before a space or newline where there is one (where byte-level BPE, SentencePiece
and WordPiece pre-tokenizers all split, so the pieces' counts add up to the text's own, give or take a
few tokens at each cut), and refused as soon as the count passes twice the context: the margin of a whole
context absorbs those differences, and the count stops after about two contexts' worth of text whatever
the text's length. A text that passes is tokenized whole, as usual; the engine's `validate` then refuses
it exactly if it does not fit.
"""

from __future__ import annotations

from typing import Any

# Natural text averages 3-5 characters per token (fewer for code and CJK): a text of up to this many
# characters per token of the context is tokenized directly
FAST_CHARS_PER_TOKEN = 8
PIECE_CHARS = 1 << 16  # characters tokenized per counting piece
CUT_SEARCH_CHARS = 1 << 10  # how far back from a piece's end a space or newline is looked for


def _piece_end(text: str, start: int) -> int:
    end = start + PIECE_CHARS
    if end >= len(text):
        return len(text)
    cut = max(text.rfind(" ", end - CUT_SEARCH_CHARS, end), text.rfind("\n", end - CUT_SEARCH_CHARS, end))
    return cut if cut > start else end


def count_exceeds(tokenizer: Any, text: str, limit: int) -> int | None:
    """The number of characters counted once the tokens of `text`, counted piece by piece, pass `limit`;
    None when the whole text holds at most `limit` tokens by that count."""
    counted, start = 0, 0
    while start < len(text):
        end = _piece_end(text, start)
        counted += len(tokenizer.encode(text[start:end], add_special_tokens=False))
        if counted > limit:
            return end
        start = end
    return None


def encode_prompt(
    tokenizer: Any, text: str, max_tokens: int, field: str = "text", **kwargs: Any
) -> list[int]:
    """The token ids of `text` (`tokenizer.encode(text, **kwargs)`), or a ValueError naming `field` when
    the text surely holds more than `max_tokens` tokens, found without tokenizing more than about
    2 * `max_tokens` tokens of it."""
    if len(text) > FAST_CHARS_PER_TOKEN * max_tokens:
        seen = count_exceeds(tokenizer, text, 2 * max_tokens)
        if seen is not None:
            raise ValueError(
                f"{field} has {len(text)} characters and more than {2 * max_tokens} tokens in its first "
                f"{seen}; the engine's context is {max_tokens} tokens"
            )
    return list(tokenizer.encode(text, **kwargs))
