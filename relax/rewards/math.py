"""The ``math`` reward: 1 if the response's final answer equals the label mathematically, else 0.

The answer is taken from the response first (``extract.final_answer``: the last ``\\boxed{}``, else
``#### X``, else "the answer is X", else the last number), then compared with the label by Hugging
Face's ``math-verify`` (``parse`` + ``verify``), which treats ``0.5``, ``1/2``, ``\\frac{1}{2}`` and
``\\dfrac12`` as equal, compares sets, intervals and equations, and simplifies symbolic expressions.
A response with no well-formed answer scores 0; scoring never raises on any response text.

``math-verify`` is the optional extra ``relax[math]``; without it the reward raises ``ImportError``,
which the scorer lets through (a missing package is a setup error, not a bad sample).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from relax.data.sample import Sample
from relax.rewards.extract import after_reasoning, final_answer

logger = logging.getLogger(__name__)

_VERIFY_TIMEOUT_S = 5  # math-verify's own SIGALRM limit; only usable on the main thread


def _signal_timeout() -> int | None:
    # math-verify times out parse/verify with signal.alarm, which raises off the main thread. In a
    # worker thread the scorer's asyncio timeout bounds the call instead.
    return _VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's warning that its timeout is off, logged at every call made without one: off
    the main thread that is on purpose (above), and a run's console got a line per scored sample."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutNotice())


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    timeout = _signal_timeout()
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return parse(text, parsing_timeout=timeout)
    parsed = parse(f"${text}$", parsing_timeout=timeout)
    return parsed if parsed else parse(text, parsing_timeout=timeout)


def _normalize(text: str) -> str:
    return "".join(text.split()).rstrip(".")


def is_equivalent(answer: str, label: Any) -> bool:
    """Whether an extracted answer equals ``label`` (a string or number, or a list of accepted ones)."""
    import math_verify  # noqa: F401  (raise ImportError here, outside the never-raise block below)

    if isinstance(label, (list, tuple)):
        return any(is_equivalent(answer, one) for one in label)
    gold_text = str(label).strip()
    if not answer.strip() or not gold_text:
        return False
    if _normalize(answer) == _normalize(gold_text):
        return True
    try:
        gold, pred = _parse(gold_text), _parse(answer)
        if not gold or not pred:
            return False
        return bool(math_verify.verify(gold, pred, timeout_seconds=_signal_timeout()))
    except Exception as e:  # a pathological expression must not fail the sample
        logger.debug("math-verify failed on answer %r vs label %r: %r", answer, gold_text, e)
        return False


def math_reward(sample: Sample, strip_reasoning: bool = True) -> float:
    """1.0 if the final answer of ``sample.response_text`` (after its reasoning block, with
    ``strip_reasoning``) equals ``sample.label``, else 0.0."""
    answer = final_answer(after_reasoning(sample.response_text, strip_reasoning))
    if answer is None:
        return 0.0
    return 1.0 if is_equivalent(answer, sample.label) else 0.0
