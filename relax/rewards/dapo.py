"""The ``dapo`` reward: +1 for a correct final answer, -1 for a wrong one, plus DAPO's soft overlong
punishment (Yu et al., 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 13).

With ``|y|`` the response length in tokens, ``L_max = max_response_length``, ``L_cache =
overlong_buffer_len`` and ``f = overlong_penalty_factor``::

    R_length(y) = 0                                 if |y| <= L_max - L_cache
                = -f * (|y| - (L_max - L_cache)) / L_cache   if L_max - L_cache < |y| <= L_max
                = -f                                 if |y| > L_max

The paper has ``f = 1``; ``f`` is the scale verl exposes. Correctness is decided by the ``math``
reward's verifier (``math-verify``), not by DAPO's "Answer:" string match. ``overlong_buffer_len = 0``
turns the length term off. The result is a dict: ``reward`` (the sum), ``acc`` (1/0) and
``overlong_penalty`` (the length term, <= 0), the latter two logged as metrics.
"""

from __future__ import annotations

from relax.data.sample import Sample
from relax.rewards.extract import after_reasoning, final_answer
from relax.rewards.math import is_equivalent


def overlong_penalty(
    response_length: int, max_response_length: int, overlong_buffer_len: int, penalty_factor: float = 1.0
) -> float:
    """DAPO's soft overlong punishment, a value in ``[-penalty_factor, 0]``: 0 up to
    ``max_response_length - overlong_buffer_len`` tokens, then linear down to ``-penalty_factor`` at
    ``max_response_length`` tokens (and beyond)."""
    if overlong_buffer_len <= 0:
        return 0.0
    expected_length = max_response_length - overlong_buffer_len
    exceed = response_length - expected_length
    if exceed <= 0:
        return 0.0
    return -penalty_factor * min(exceed / overlong_buffer_len, 1.0)


def dapo(
    sample: Sample,
    max_response_length: int,
    overlong_buffer_len: int = 0,
    overlong_penalty_factor: float = 1.0,
    strip_reasoning: bool = True,
) -> dict[str, float]:
    """+1/-1 correctness (math verifier) plus the overlong penalty of ``sample.response_length`` tokens."""
    if not 0 <= overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in [0, max_response_length={max_response_length}], "
            f"got {overlong_buffer_len}"
        )
    answer = final_answer(after_reasoning(sample.response_text, strip_reasoning))
    correct = answer is not None and is_equivalent(answer, sample.label)
    penalty = overlong_penalty(
        sample.response_length, max_response_length, overlong_buffer_len, overlong_penalty_factor
    )
    return {
        "reward": (1.0 if correct else -1.0) + penalty,
        "acc": float(correct),
        "overlong_penalty": penalty,
    }
