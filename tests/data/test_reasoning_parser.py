"""The `<think>` reasoning parsers (relax/data/reasoning.py): whole outputs of both styles,
and the streaming splitter giving the same split for every way of cutting the text into chunks."""

from __future__ import annotations

import random

import pytest

from relax.data.reasoning import (
    REASONING_PARSERS,
    ReasoningSplitter,
    reasoning_style,
    split_reasoning,
    strip_reasoning,
)

QWEN3 = REASONING_PARSERS["qwen3"]
R1 = REASONING_PARSERS["deepseek-r1"]


@pytest.mark.parametrize(
    "style, text, expected",
    [
        (QWEN3, "<think>\nadd 2 and 2\n</think>\n\nIt is 4.", ("add 2 and 2", "It is 4.")),
        (QWEN3, "  <think>a</think>b", ("a", "b")),
        (QWEN3, "It is 4.", (None, "It is 4.")),  # enable_thinking false: no block in the output
        (QWEN3, "\n\nIt is 4.", (None, "\n\nIt is 4.")),
        (QWEN3, "<think>cut by max_tokens", ("cut by max_tokens", "")),
        (QWEN3, "<think></think>x", ("", "x")),
        (QWEN3, "answer <think>late</think>", (None, "answer <think>late</think>")),
        (R1, "add 2 and 2\n</think>\n\nIt is 4.", ("add 2 and 2", "It is 4.")),  # <think> was in the prompt
        (R1, "<think>a</think>b", ("a", "b")),
        (R1, "never closed", ("never closed", "")),
        (R1, "a</think>b</think>c", ("a", "b</think>c")),
    ],
)
def test_split_whole_outputs(style, text, expected):
    assert split_reasoning(text, style) == expected


def test_strip_reasoning_for_rewards():
    assert strip_reasoning("<think>2+2 is 5?</think>\nThe answer is 4") == "The answer is 4"
    assert strip_reasoning("2+2 is 5?</think> 4") == "4"  # R1: the block opened in the prompt
    assert strip_reasoning("<think>the answer is 4 ...") == ""  # no answer written
    assert strip_reasoning("The answer is 4") == "The answer is 4"


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="deepseek-r1, qwen3"):
        reasoning_style("qwen")


def _stream(style, chunks):
    splitter = ReasoningSplitter(style)
    reasoning = answer = ""
    for c in chunks:
        r, a = splitter.add(c)
        assert not (r and answer), "reasoning after the answer began"
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.finish()
    return reasoning + r, answer + a


TEXTS = [
    "<think>\nadd 2 and 2\n</think>\n\nIt is 4.",
    "  <think> a  b </think>  c ",
    "It is 4.",
    "\n\nIt is 4.",
    "<think>cut by max_tokens  ",
    "<think>a </thi",
    "<thin",
    "<think>",
    "   ",
    "",
    "x</think>y",
    "a</think>b</think>c",
    "answer <think>late</think>",
    "<think>a</think>",
    "<think>a</think>   ",
    "</think>only",
]


@pytest.mark.parametrize("style", [QWEN3, R1], ids=lambda s: s.name)
def test_stream_matches_whole_split_for_every_chunking(style):
    rng = random.Random(0)
    for text in TEXTS:
        expected_reasoning, expected_answer = split_reasoning(text, style)
        expected = (expected_reasoning or "", expected_answer)
        assert _stream(style, list(text)) == expected, text  # one character at a time
        assert _stream(style, [text]) == expected, text
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 4))))
            chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            assert _stream(style, chunks) == expected, (text, chunks)


def test_stream_releases_reasoning_before_the_block_ends():
    splitter = ReasoningSplitter(QWEN3)
    assert splitter.add("<th") == ("", "")  # may be the opening tag
    assert splitter.add("ink>step one") == ("step one", "")
    assert splitter.add(" </th") == ("", "")  # may be the closing tag: held with the space before it
    assert splitter.add("ink>\n\nIt") == ("", "It")
    assert splitter.add(" is 4.") == ("", " is 4.")
