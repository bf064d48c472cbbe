"""pass@k and mean@k against hand-computed values."""

from __future__ import annotations

import math

import pytest

from relax.data.sample import Sample, SampleStatus
from relax.rollout.eval_metrics import eval_metrics, pass_at_k


@pytest.mark.parametrize(
    "n,c,k,want",
    [
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (4, 1, 1, 0.25),  # c/n
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 4, 1 - math.comb(7, 4) / math.comb(10, 4)),
        (4, 3, 2, 1.0),  # n - c < k: every draw of 2 contains a correct one
        (8, 0, 8, 0.0),
    ],
)
def test_pass_at_k_closed_form(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(2, 3, 1)


def _s(group, sid, reward, length=3, status=SampleStatus.COMPLETED):
    return Sample(
        index=group,
        prompt="p",
        group_id=group,
        sample_id=sid,
        reward=reward,
        response_ids=[1] * length,
        status=status,
    )


def test_eval_metrics_by_hand():
    samples = [
        _s(0, 0, 1.0),
        _s(0, 1, 0.0),
        _s(0, 2, 0.0),
        _s(0, 3, 1.0),  # 2 of 4 correct
        _s(1, 0, 0.0),
        _s(1, 1, 0.0),
        _s(1, 2, 0.0),
        _s(1, 3, 0.0, length=5, status=SampleStatus.TRUNCATED),
    ]
    m = eval_metrics(samples, k_values=[1, 2], correct_threshold=0.5)
    assert m["reward_mean"] == pytest.approx(2 / 8)
    assert m["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["pass@2"] == pytest.approx(((1 - math.comb(2, 2) / math.comb(4, 2)) + 0.0) / 2)
    assert m["mean@1"] == pytest.approx((1.0 + 0.0) / 2)  # first sample of each prompt
    assert m["mean@2"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["truncated_frac"] == pytest.approx(1 / 8)
    assert m["response_len_mean"] == pytest.approx((7 * 3 + 5) / 8)
    assert m["num_prompts"] == 2
