"""The ``format_think_answer`` reward: 1 if the response is ``<think>...</think>`` followed by
``<answer>...</answer>`` and nothing else (whitespace aside), else 0.

Each tag must appear exactly once, so a response that nests or repeats the blocks scores 0. Typically
combined with a correctness reward by a user function that adds a weighted format bonus.
"""

from __future__ import annotations

import re

from relax.data.sample import Sample

_THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def has_think_answer_format(text: str) -> bool:
    """Whether ``text`` is exactly one think block then exactly one answer block."""
    if any(text.count(tag) != 1 for tag in _TAGS):
        return False
    return _THINK_ANSWER.fullmatch(text) is not None


def format_think_answer(sample: Sample) -> float:
    """1.0 if ``sample.response_text`` has the ``<think>...</think><answer>...</answer>`` shape, else 0.0."""
    return 1.0 if has_think_answer_format(sample.response_text) else 0.0
