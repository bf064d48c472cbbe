"""Pulling the answer out of a model's response: the text after a reasoning model's ``<think>`` block
(``after_reasoning``), then ``\\boxed{...}``, ``<answer>...</answer>``, "the answer is X", "#### X", the
first or last number. Pure string functions shared by the built-in rewards; each returns ``None`` when
the response holds no well-formed answer of that form.
"""

from __future__ import annotations

import re

from relax.data.reasoning import strip_reasoning

_BOXED_CMDS = ("\\boxed", "\\fbox")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_HASHES = re.compile(r"####\s*(.+)")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
# An integer or decimal, optionally with thousands separators or as a simple fraction a/b.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_SIMPLE_NUMBER = re.compile(r"-?\d+(?:\.\d+)?|-?\.\d+")


def after_reasoning(text: str, strip: bool = True) -> str:
    """The part of a response a built-in reward scores: with `strip`, what follows the reasoning block
    (`...</think>`, the block opened by the model or by the prompt as DeepSeek-R1's template does; ""
    for a response whose `<think>` never closes: it wrote no answer); else the whole text."""
    return strip_reasoning(text) if strip else text


def balanced_braces(text: str, open_at: int) -> str | None:
    """The content of the ``{...}`` group whose ``{`` is at ``text[open_at]``; ``None`` if unbalanced."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif text[i] == "}" and (i == 0 or text[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed X``), nested braces kept.

    ``None`` if there is none, or if the last one is malformed (unbalanced braces, nothing boxed).
    """
    start = max(text.rfind(cmd) for cmd in _BOXED_CMDS)
    if start < 0:
        return None
    rest_at = start + len("\\boxed") if text.startswith("\\boxed", start) else start + len("\\fbox")
    i = rest_at
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        content = balanced_braces(text, i)
    elif i > rest_at:  # "\boxed 5": the token after the space
        content = re.split(r"[\s$]", text[i:], maxsplit=1)[0]
    else:
        return None
    if content is None or not content.strip():
        return None
    return content.strip()


def answer_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>``, stripped."""
    found = _ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def _clean(answer: str) -> str:
    """Strip math delimiters, markdown emphasis and a trailing period from a one-line answer."""
    answer = answer.strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) >= len(left) + len(right):
            answer = answer[len(left) : len(answer) - len(right)].strip()
    answer = answer.rstrip(".").strip()
    return answer.strip("$").strip()


def final_answer(text: str) -> str | None:
    """The model's final answer, tried in order: the last ``\\boxed{}``, ``#### X``, "answer is X", the
    last number. A response with a malformed last ``\\boxed`` has no answer (``None``)."""
    if any(cmd in text for cmd in _BOXED_CMDS):
        return last_boxed(text)
    for pattern in (_HASHES, _ANSWER_IS):
        found = pattern.findall(text)
        if found:
            answer = _clean(re.split(r"\.\s", found[-1], maxsplit=1)[0])  # up to the sentence's end
            if answer:
                return answer
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def first_number(text: str) -> float | None:
    """The first integer or decimal in ``text`` as a float (``"3+4=7"`` gives 3.0; ``"7"`` gives 7.0)."""
    found = _SIMPLE_NUMBER.search(text)
    return float(found.group(0)) if found else None


def answer_span(text: str) -> str:
    """The ``<answer>`` content if present, else the last ``\\boxed{}`` content, else the whole text."""
    tagged = answer_tag(text)
    if tagged is not None:
        return tagged
    boxed = last_boxed(text)
    return boxed if boxed is not None else text
