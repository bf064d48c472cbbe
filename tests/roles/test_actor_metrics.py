"""The Actor's engine-vs-trainer log-prob mismatch metric: masked tokens and unusable rows left out."""

from __future__ import annotations

import pytest
import torch

from relax.data.batch import TrainBatch
from relax.roles.actor import _mismatch_metrics


def batch(old: list[list[float]], rollout: list[list[float]], mask: list[list[float]]) -> TrainBatch:
    n = len(old)
    return TrainBatch(
        prompt_ids=[[1]] * n,
        response_ids=[[2] * len(r) for r in rollout],
        loss_mask=mask,
        rollout_log_probs=rollout,
        rewards=[0.0] * n,
        group_index=list(range(n)),
        weight_versions=[0] * n,
        old_log_probs=[torch.tensor(o) for o in old],
    )


def test_mismatch_counts_trained_tokens_of_rows_whose_lengths_agree() -> None:
    m = _mismatch_metrics(
        batch(
            old=[[-1.0, -2.0, -3.0], [-0.5], [-1.0, -1.0], []],
            rollout=[[-1.5, -2.0, -9.0], [-0.25], [-1.0], []],  # row 2: lengths differ; row 3: empty
            mask=[[1, 1, 0], [1], [1], []],  # the -9 of row 0 is masked
        )
    )
    assert m["train/rollout_logp_abs_diff_mean"] == pytest.approx((0.5 + 0.0 + 0.25) / 3)
    assert m["train/rollout_logp_abs_diff_max"] == pytest.approx(0.5)


def test_no_comparable_token_gives_no_metric() -> None:
    assert _mismatch_metrics(batch([[-1.0]], [[-2.0]], [[0]])) == {}
    assert _mismatch_metrics(batch([[-1.0, -1.0]], [[-2.0]], [[1]])) == {}
