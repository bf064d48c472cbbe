"""A streamed chat reply adds up to exactly the message a non-streamed request gets."""

from __future__ import annotations

import pytest

from relax.engine_api.openai.streaming import ChoiceStream
from relax.engine_api.openai.tool_calls import parse_tool_calls


class ByteTokenizer:
    """Byte-level ids, decoded as a BPE tokenizer does: an incomplete UTF-8 character reads U+FFFD."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def stream(raw: bytes, parse_tools: bool) -> tuple[str, str]:
    """(what the client joined from the deltas, the final message content)."""
    s = ChoiceStream(ByteTokenizer(), True, [], parse_tools)
    joined = "".join(s.add([b], [0.0], [None]) for b in raw)
    text = ByteTokenizer().decode(list(raw))
    final = parse_tool_calls(text).content if parse_tools else text
    return joined + s.finish(final), final


@pytest.mark.parametrize(
    "raw",
    [
        b" do\xe4mck3\xe4",  # a leading space, and the output cut inside a character
        b"  ab \n",
        b"\n\nx y\t",
        b" caf\xc3\xa9 \xe4",
        b"   ",
        b"plain",
    ],
)
@pytest.mark.parametrize("parse_tools", [True, False])
def test_streamed_deltas_add_up_to_the_message(raw, parse_tools):
    joined, final = stream(raw, parse_tools)
    assert joined == final


def test_text_before_a_tool_call_is_the_messages_content():
    s = ChoiceStream(ByteTokenizer(), True, [], True)
    raw = b' well  <tool_call>\n{"name": "calc", "arguments": {"expr": "1"}}\n</tool_call>'
    joined = "".join(s.add([b], [0.0], [None]) for b in raw)
    parsed = parse_tool_calls(raw.decode())
    assert [c.name for c in parsed.tool_calls] == ["calc"]
    assert joined + s.finish(parsed.content) == parsed.content == "well"
