"""Built-in rewards on reasoning models' responses: the answer after the `<think>` block is scored, not a
number or letter the model considered while thinking (Qwen3 style, the block opened by the model;
DeepSeek-R1 style, opened by the prompt so only `</think>` is in the response). `reward.strip_reasoning:
false` scores the whole text again."""

from __future__ import annotations

import pytest

from relax.data.sample import Sample
from relax.rewards import RewardConfig, RewardScorer
from relax.rewards.choice import multiple_choice
from relax.rewards.dapo import dapo
from relax.rewards.format import format_think_answer
from relax.rewards.genrm import judge_item
from relax.rewards.math import math_reward
from relax.rewards.text import exact_match, f1, first_number

QWEN3 = "<think>\nIs it 5? The answer is 5... no, 2+2 is 4.\n</think>\n\n"
R1 = "Is it 5? The answer is 5... no, 2+2 is 4.\n</think>\n\n"


def sample(response: str, label: object) -> Sample:
    return Sample(index=0, prompt="2+2?", label=label, response_text=response, response_ids=[1] * 8)


@pytest.mark.parametrize("thinking", [QWEN3, R1], ids=["qwen3", "deepseek-r1"])
@pytest.mark.parametrize(
    "reward, answer, label",
    [
        (math_reward, "The answer is \\boxed{4}", "4"),
        (exact_match, "4", "4"),
        (first_number, "4", "4"),
        (f1, "four", "four"),
        (multiple_choice, "Answer: B", "B"),
    ],
    ids=lambda x: getattr(x, "__name__", None),
)
def test_answer_after_the_reasoning_is_scored(reward, answer, label, thinking):
    pytest.importorskip("math_verify")
    assert reward(sample(thinking + answer, label)) == 1.0
    # the reasoning's "5" (and its "The answer is") is not taken for the answer
    wrong = {"4": "5", "four": "five", "B": "A"}[label]
    assert reward(sample(thinking + answer.replace(label, wrong), label)) == 0.0


def test_reasoning_would_have_misled_the_reward():
    """Without stripping, the reasoning's first number decides `first_number`: the behaviour this fixes."""
    s = sample(QWEN3 + "4", "4")
    assert first_number(s, strip_reasoning=False) == 0.0 and first_number(s) == 1.0
    s = sample("<think>The answer is A? No.</think>\n\nB", "B")
    assert multiple_choice(s, strip_reasoning=False) == 0.0 and multiple_choice(s) == 1.0


def test_unclosed_reasoning_has_no_answer():
    pytest.importorskip("math_verify")
    s = sample("<think>the answer is \\boxed{4} I guess, let me check", "4")  # cut by max tokens
    assert math_reward(s) == 0.0 and first_number(s) == 0.0
    assert math_reward(s, strip_reasoning=False) == 1.0


def test_dapo_and_genrm_see_the_answer_only():
    pytest.importorskip("math_verify")
    assert dapo(sample(QWEN3 + "\\boxed{4}", "4"), max_response_length=100)["acc"] == 1.0
    assert judge_item(sample(QWEN3 + "It is 4.", "4"))["response"] == "It is 4."
    assert judge_item(sample(QWEN3 + "It is 4.", "4"), strip_reasoning=False)["response"].startswith(
        "<think>"
    )


def test_format_reward_still_sees_the_whole_response():
    assert format_think_answer(sample("<think>x</think><answer>4</answer>", "4")) == 1.0


def test_config_switch_reaches_the_builtins():
    on, off = RewardConfig(name="first_number"), RewardConfig(name="first_number", strip_reasoning=False)
    assert on.strip_reasoning and on.kwargs_for("first_number") == {}
    assert off.kwargs_for("first_number") == {"strip_reasoning": False}
    assert off.kwargs_for("format_think_answer") == {}  # it takes no such argument
    override = RewardConfig(name="first_number", strip_reasoning=False, kwargs={"strip_reasoning": True})
    assert override.kwargs_for("first_number") == {"strip_reasoning": True}
    scored = []
    for cfg in (on, off):
        batch = [sample(QWEN3 + "4", "4")]
        RewardScorer(cfg).score_sync(batch)
        scored.append(batch[0].reward)
    assert scored == [1.0, 0.0]


def test_a_thinking_judge_gives_its_verdict_after_the_reasoning():
    from relax.rewards.genrm import DEFAULT_VERDICT_PATTERN, parse_verdict

    scores = {"CORRECT": 1.0, "INCORRECT": 0.0}
    assert (
        parse_verdict(
            "<think>Verdict: INCORRECT? no.</think>\nVerdict: CORRECT", DEFAULT_VERDICT_PATTERN, scores
        )
        == "CORRECT"
    )
    assert parse_verdict("<think>Verdict: CORRECT", DEFAULT_VERDICT_PATTERN, scores) is None  # never finished
