"""The ``multiple_choice`` reward: 1 if the letter the response picks equals the label's letter, else 0.

The letter is found, in order of trust, in the last ``\\boxed{B}``, in the last "answer: (B)" /
"The answer is B" / "Answer: **B**", or as the whole response ("B", "(B)", "B."). Only capital letters
count after "answer is", so "the answer is a bit unclear" picks nothing. The label is a letter in any of
those forms, or an int taken as a 0-based option index (as in MMLU rows: 1 means "B").
"""

from __future__ import annotations

import re
from typing import Any

from relax.data.sample import Sample
from relax.rewards.extract import after_reasoning, last_boxed

# "answer" (any case), optional "is", optional colon, optional markdown bold and parenthesis, a capital.
_ANSWER_LETTER = re.compile(r"(?i:answer)(?:\s+(?i:is))?\s*[:：]?\s*(?:\*\*)?\s*[(\[]?([A-Z])(?![A-Za-z0-9])")
# A lone letter: "B", "(B)", "B.", "B)", "[B]", "**B**", "\text{B}".
_LONE = r"^\s*(?:\*\*)?(?:\\text\{)?[(\[]?([A-Za-z])(?:[)\].:}]|\*\*)*"
_LONE_LETTER = re.compile(_LONE + r"\s*$")
_LABEL_LETTER = re.compile(_LONE + r"(?:\s.*)?$", re.DOTALL)  # also "B) the option's text"


def choice_letter(text: str) -> str | None:
    """The option letter ``text`` picks, upper-cased; ``None`` if it picks none."""
    boxed = last_boxed(text)
    if boxed is not None:
        found = _LONE_LETTER.match(boxed)
        return found.group(1).upper() if found else None
    picks = _ANSWER_LETTER.findall(text)
    if picks:
        return picks[-1]
    found = _LONE_LETTER.match(text)  # a reply that is just the letter, maybe bracketed
    return found.group(1).upper() if found else None


def _label_letter(label: Any) -> str | None:
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return chr(ord("A") + label) if 0 <= label < 26 else None
    text = str(label).strip()
    found = _LABEL_LETTER.match(text)
    return found.group(1).upper() if found else choice_letter(text)


def multiple_choice(sample: Sample, strip_reasoning: bool = True) -> float:
    """1.0 if the option picked by ``sample.response_text`` (after its reasoning block, with
    ``strip_reasoning``) is ``sample.label``, else 0.0."""
    picked = choice_letter(after_reasoning(sample.response_text, strip_reasoning))
    return 1.0 if picked is not None and picked == _label_letter(sample.label) else 0.0
