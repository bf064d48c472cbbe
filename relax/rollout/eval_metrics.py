"""Evaluation statistics over prompt groups: the unbiased pass@k estimator and mean@k."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from relax.data.sample import Sample, SampleStatus


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating Large Language
    Models Trained on Code", arXiv:2107.03374):

        pass@k = 1 - C(n - c, k) / C(n, k)

    the probability that at least one of k samples drawn without replacement from the n is correct.
    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i) for numerical stability.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def eval_metrics(samples: list[Sample], k_values: list[int], correct_threshold: float) -> dict[str, float]:
    """Per-set metrics: mean reward, pass@k and mean@k (mean reward of the first k samples of each prompt,
    averaged over prompts), response length, truncation rate."""
    groups: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.group_id].append(s)
    out: dict[str, float] = {
        "reward_mean": statistics.fmean(float(s.reward or 0.0) for s in samples),
        "response_len_mean": statistics.fmean(s.response_length for s in samples),
        "truncated_frac": statistics.fmean(s.status == SampleStatus.TRUNCATED for s in samples),
        "num_prompts": float(len(groups)),
    }
    for k in k_values:
        passes, means = [], []
        for group in groups.values():
            group = sorted(group, key=lambda s: s.sample_id)
            correct = sum(float(s.reward or 0.0) >= correct_threshold for s in group)
            passes.append(pass_at_k(len(group), correct, k))
            means.append(statistics.fmean(float(s.reward or 0.0) for s in group[:k]))
        out[f"pass@{k}"] = statistics.fmean(passes)
        out[f"mean@{k}"] = statistics.fmean(means)
    return out
