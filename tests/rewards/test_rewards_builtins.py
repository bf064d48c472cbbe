"""Each built-in reward on real-looking responses, with expected values worked out by hand."""

from __future__ import annotations

import pytest

from relax.data.sample import Sample
from relax.rewards.choice import multiple_choice
from relax.rewards.dapo import dapo, overlong_penalty
from relax.rewards.extract import final_answer, last_boxed
from relax.rewards.format import format_think_answer
from relax.rewards.math import math_reward
from relax.rewards.text import exact_match, f1, first_number, token_f1


def sample(response: str, label: object = None, n_tokens: int = 0) -> Sample:
    return Sample(index=0, prompt="q", label=label, response_text=response, response_ids=[1] * n_tokens)


# -- answer extraction --


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{\\dfrac{3}{4}}", "\\dfrac{3}{4}"),  # the last one
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
        ("$\\boxed 5$", "5"),
        ("\\fbox{7}", "7"),
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced
        ("\\boxed{}", None),
        ("no box", None),
    ],
)
def test_last_boxed(text: str, expected: str | None) -> None:
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Step 1 ... #### 1,000", "1,000"),
        ("Thus the answer is $\\frac{2}{3}$.", "\\frac{2}{3}"),
        ("The final answer is 42. Hope it helps.", "42"),
        ("3 apples and 4 pears make 7", "7"),  # last number
        ("it costs 1,250 dollars", "1250"),
        ("\\boxed{2} and \\boxed{3", None),  # a malformed last box is no answer
        ("", None),
        ("no digits here", None),
    ],
)
def test_final_answer(text: str, expected: str | None) -> None:
    assert final_answer(text) == expected


# -- math --


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("The result is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("The result is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("So we get \\boxed{\\dfrac{3}{4}}.", "0.75", 1.0),
        ("\\boxed{\\frac34}", "3/4", 1.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", 1.0),
        ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", 1.0),
        ("\\boxed{x = 2}", "2", 1.0),
        ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
        ("The answer is $-3$.", "-3.0", 1.0),
        ("3 + 4 = 7", 7, 1.0),  # last number, integer label
        ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
        ("\\boxed{7}", "8", 0.0),
        ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", 0.0),  # unbalanced braces
        ("", "1", 0.0),
        ("I don't know.", "1", 0.0),
        ("\\boxed{\\frac{}{}}^^{", "1", 0.0),  # garbage LaTeX
        ("\\boxed{5}", ["4", "5"], 1.0),  # any accepted label
    ],
)
def test_math(response: str, label: object, expected: float) -> None:
    assert math_reward(sample(response, label)) == expected


def test_math_off_the_main_thread_scores_without_a_warning_per_call(caplog) -> None:
    """The scorer's worker threads call math-verify without its signal timeout; its notice that the
    timeout is off is dropped (one line per scored sample on a run's console), other warnings are not."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    with caplog.at_level(logging.WARNING), ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_reward, sample("\\boxed{\\frac{1}{2}}", "0.5")).result() == 1.0
        logging.getLogger("math_verify.parser").warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


# -- multiple choice --


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("Let me think... answer: (B)", "B", 1.0),
        ("Therefore \\boxed{B}", "B", 1.0),
        ("\\boxed{\\text{C}}", "C", 1.0),
        ("The answer is B.", "(B)", 1.0),
        ("The correct answer is **D**", "D", 1.0),
        ("Answer: C", "c", 1.0),
        ("(A)", "A", 1.0),
        ("b", "B", 1.0),
        ("The answer is B", 1, 1.0),  # 0-based index label
        ("answer: (B)", "B) Paris", 1.0),  # label with the option's text
        ("The answer is A. Wait, the answer is C", "C", 1.0),  # the last statement counts
        ("The answer is B", "C", 0.0),
        ("the answer is a bit unclear", "A", 0.0),
        ("I think", "I", 0.0),
        ("", "A", 0.0),
    ],
)
def test_multiple_choice(response: str, label: object, expected: float) -> None:
    assert multiple_choice(sample(response, label)) == expected


# -- text rewards --


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("  Paris. ", "paris", 1.0),
        ("New   York\nCity", "new york city", 1.0),
        ("<think>hmm</think><answer> Paris </answer>", "Paris", 1.0),
        ("so \\boxed{Paris}", "Paris", 1.0),
        ("Paris, France", "Paris", 0.0),
        ("", "Paris", 0.0),
        ("Lyon", ["Paris", "Lyon"], 1.0),
    ],
)
def test_exact_match(response: str, label: object, expected: float) -> None:
    assert exact_match(sample(response, label)) == expected


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("7", "7", 1.0),  # the toy task 3+4=
        (" 7<|im_end|>", "7", 1.0),
        ("7.0 is it", "7", 1.0),
        ("-2", "-2", 1.0),
        ("8", "7", 0.0),
        ("17", "7", 0.0),
        ("7 or 8", "8", 0.0),  # only the first number counts
        ("seven", "7", 0.0),
        ("7", "seven", 0.0),  # non-numeric label never matches
        ("", "7", 0.0),
    ],
)
def test_first_number(response: str, label: object, expected: float) -> None:
    assert first_number(sample(response, label)) == expected


def test_f1_by_hand() -> None:
    # pred tokens [cat, sat, on, mat] (articles dropped), truth [cat, sat]: overlap 2,
    # P = 2/4, R = 2/2, F1 = 2 * 0.5 * 1 / 1.5 = 2/3.
    assert token_f1("The cat sat on the mat.", "the cat sat") == pytest.approx(2 / 3)
    assert token_f1("Cat, sat!", "the cat sat") == 1.0  # punctuation and case ignored
    assert token_f1("dog", "cat") == 0.0
    assert token_f1("", "") == 1.0
    assert token_f1("the", "cat") == 0.0  # only an article: no token
    # repeated tokens count by multiplicity: pred [a_, a_] vs truth [a_]: c = 1, P = 1/2, R = 1, F1 = 2/3
    assert token_f1("yes yes", "yes") == pytest.approx(2 / 3)
    assert f1(sample("<answer>the cat sat</answer>", ["dog", "cat sat"])) == 1.0
    assert f1(sample("anything", None)) == 0.0


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>2+2 is 4</think><answer>4</answer>", 1.0),
        ("\n<think>\nwork\n</think>\n\n<answer>4</answer>\n", 1.0),
        ("<think></think><answer></answer>", 1.0),
        ("<answer>4</answer>", 0.0),
        ("<think>x</think>", 0.0),
        ("<answer>4</answer><think>x</think>", 0.0),  # wrong order
        ("<think>x</think><answer>4</answer> and more", 0.0),  # trailing text
        ("<think>x</think><answer>4</answer><answer>5</answer>", 0.0),  # repeated
        ("<think><think>x</think></think><answer>4</answer>", 0.0),  # nested
        ("", 0.0),
    ],
)
def test_format_think_answer(response: str, expected: float) -> None:
    assert format_think_answer(sample(response)) == expected


# -- dapo --


def test_overlong_penalty_by_hand() -> None:
    # L_max = 100, L_cache = 20: no penalty up to 80 tokens, then -(L - 80) / 20, down to -1 at 100.
    assert overlong_penalty(50, 100, 20) == 0.0
    assert overlong_penalty(80, 100, 20) == 0.0
    assert overlong_penalty(85, 100, 20) == pytest.approx(-0.25)
    assert overlong_penalty(90, 100, 20) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 20) == pytest.approx(-1.0)
    assert overlong_penalty(130, 100, 20) == pytest.approx(-1.0)  # clipped past L_max
    assert overlong_penalty(90, 100, 20, penalty_factor=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(100, 100, 0) == 0.0  # buffer 0: off


def test_dapo_reward_by_hand() -> None:
    kw = {"max_response_length": 100, "overlong_buffer_len": 20}
    assert dapo(sample("\\boxed{\\frac{1}{2}}", "0.5", n_tokens=40), **kw) == {
        "reward": 1.0,
        "acc": 1.0,
        "overlong_penalty": 0.0,
    }
    wrong = dapo(sample("\\boxed{3}", "4", n_tokens=40), **kw)
    assert wrong["reward"] == -1.0 and wrong["acc"] == 0.0
    # correct at 90 tokens: 1 - (90 - 80) / 20 = 0.5
    assert dapo(sample("\\boxed{4}", "4", n_tokens=90), **kw)["reward"] == pytest.approx(0.5)
    # wrong at 95 tokens with factor 2: -1 - 2 * 15 / 20 = -2.5
    out = dapo(sample("\\boxed{3}", "4", n_tokens=95), **kw, overlong_penalty_factor=2.0)
    assert out["reward"] == pytest.approx(-2.5) and out["overlong_penalty"] == pytest.approx(-1.5)
    assert dapo(sample("", "4", n_tokens=100), max_response_length=100)["reward"] == -1.0  # no buffer
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        dapo(sample("x", "4"), max_response_length=10, overlong_buffer_len=20)
