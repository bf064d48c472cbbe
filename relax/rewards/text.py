"""String rewards: ``exact_match``, ``first_number`` and ``f1``.

Each scores the response after its reasoning block (``strip_reasoning``, ``extract.after_reasoning``).
``exact_match`` and ``f1`` first narrow the response to its answer (``<answer>...</answer>``, else the
last ``\\boxed{}``, else the whole text). A label may be a list of accepted answers; the best one counts.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any

from relax.data.sample import Sample
from relax.rewards import extract

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def _labels(label: Any) -> list[str]:
    if label is None:
        return []
    if isinstance(label, (list, tuple)):
        return [str(one) for one in label]
    return [str(label)]


def normalize(text: str) -> str:
    """Strip, collapse whitespace, lower-case, drop one trailing period: ``" Paris. "`` -> ``"paris"``."""
    text = " ".join(text.split()).lower()
    return text[:-1].rstrip() if text.endswith(".") else text


def exact_match(sample: Sample, strip_reasoning: bool = True) -> float:
    """1.0 if the normalized answer of the response equals the normalized label (or one of them)."""
    answer = normalize(extract.answer_span(extract.after_reasoning(sample.response_text, strip_reasoning)))
    return 1.0 if any(answer == normalize(label) for label in _labels(sample.label)) else 0.0


def first_number(sample: Sample, strip_reasoning: bool = True) -> float:
    """1.0 if the first integer/decimal in the response equals the label numerically, else 0.0.

    Used by the arithmetic toy task: prompt ``"3+4="``, label ``"7"``, response ``"7"`` scores 1.
    """
    value = extract.first_number(extract.after_reasoning(sample.response_text, strip_reasoning))
    if value is None:
        return 0.0
    for label in _labels(sample.label):
        try:
            if abs(float(label.strip()) - value) <= 1e-9 * max(1.0, abs(value)):
                return 1.0
        except ValueError:
            continue
    return 0.0


def squad_normalize(text: str) -> str:
    """SQuAD's answer normalization: lower-case, drop punctuation and articles, collapse whitespace."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, truth: str) -> float:
    """Token-level F1 of two answers after ``squad_normalize`` (SQuAD v1.1 ``f1_score``).

    With ``c`` the multiset overlap of tokens, ``P = c/|pred|``, ``R = c/|truth|``, ``F1 = 2PR/(P+R)``.
    If either side has no token, F1 is 1 when both have none, else 0 (SQuAD v2's rule).
    """
    pred_tokens = squad_normalize(prediction).split()
    truth_tokens = squad_normalize(truth).split()
    if not pred_tokens or not truth_tokens:
        return float(pred_tokens == truth_tokens)
    common = sum((Counter(pred_tokens) & Counter(truth_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(truth_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(sample: Sample, strip_reasoning: bool = True) -> float:
    """Token-level F1 between the response's answer and the label (the best over a list of labels)."""
    answer = extract.answer_span(extract.after_reasoning(sample.response_text, strip_reasoning))
    return max((token_f1(answer, label) for label in _labels(sample.label)), default=0.0)
