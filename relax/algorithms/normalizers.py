"""Reward normalizers per prompt group: scalar reward per sample -> scalar score per sample.

Samples with equal ``group_index_N`` form a group (they need not be contiguous). A normalizer that
needs groups raises ``ValueError`` on a group of size 1, or, when ``group_size`` is given, on a group
of any other size -- never a silent NaN or a silent zero advantage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

GROUP_EPS = 1e-6  # added to the group std before dividing


def group_stats(
    values_N: Tensor, group_index_N: Tensor, group_size: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, unbiased group std and group size, each [N].

    Raises ``ValueError`` on a group of size < 2, or of size != ``group_size`` when given.
    """
    if values_N.dim() != 1 or group_index_N.shape != values_N.shape:
        raise ValueError(
            f"want 1-D rewards and group indices of one shape, got {values_N.shape}, {group_index_N.shape}"
        )
    _, inverse_N = torch.unique(group_index_N, return_inverse=True)
    num_groups = int(inverse_N.max().item()) + 1 if inverse_N.numel() else 0
    values = values_N.double()
    count_G = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(
        0, inverse_N, torch.ones_like(values)
    )
    bad = (count_G < 2) if group_size is None else (count_G != group_size)
    if bool(bad.any()):
        sizes = sorted({int(c) for c in count_G[bad].tolist()})
        want = "at least 2" if group_size is None else str(group_size)
        raise ValueError(
            f"{int(bad.sum())} prompt group(s) have size {sizes}, want {want}; group normalizers need "
            "complete groups (check n_samples_per_prompt and that partial groups are not sent to training)"
        )
    sum_G = torch.zeros_like(count_G).index_add_(0, inverse_N, values)
    mean_G = sum_G / count_G
    sq_G = torch.zeros_like(count_G).index_add_(0, inverse_N, (values - mean_G[inverse_N]) ** 2)
    std_G = (sq_G / (count_G - 1)).sqrt()
    dtype = values_N.dtype
    return mean_G[inverse_N].to(dtype), std_G[inverse_N].to(dtype), count_G[inverse_N].to(dtype)


def group_mean_std(rewards_N: Tensor, group_index_N: Tensor, group_size: int | None = None) -> Tensor:
    r"""GRPO outcome advantage: :math:`\hat A_i = (r_i - \mathrm{mean}_g(r)) / (\mathrm{std}_g(r) + \epsilon)`.

    Shao et al. 2024, DeepSeekMath (arXiv:2402.03300), eq. for outcome supervision.
    Departures: the std is the unbiased (Bessel) std as in verl/TRL; ``eps = 1e-6`` keeps a group whose
    rewards all agree finite (its scores are exactly 0).
    """
    mean_N, std_N, _ = group_stats(rewards_N, group_index_N, group_size)
    return (rewards_N - mean_N) / (std_N + GROUP_EPS)


def group_mean(rewards_N: Tensor, group_index_N: Tensor, group_size: int | None = None) -> Tensor:
    r"""Group-centred reward without std: :math:`\hat A_i = r_i - \mathrm{mean}_g(r)`.

    Dr. GRPO (Liu et al. 2025, arXiv:2503.20783) drops GRPO's std division, which up-weights
    too-easy and too-hard prompts; also REINFORCE++-baseline's group-mean baseline.
    """
    mean_N, _, _ = group_stats(rewards_N, group_index_N, group_size)
    return rewards_N - mean_N


def leave_one_out(rewards_N: Tensor, group_index_N: Tensor, group_size: int | None = None) -> Tensor:
    r"""RLOO baseline: :math:`\hat A_i = r_i - \frac{1}{G-1}\sum_{j\ne i} r_j = \frac{G}{G-1}(r_i - \bar r_g)`.

    Ahmadian et al. 2024, Back to Basics (arXiv:2402.14740), eq. 7. Computed through the identity on
    the right (the G/(G-1) scaling of the group-centred reward). No departure.
    """
    mean_N, _, count_N = group_stats(rewards_N, group_index_N, group_size)
    return count_N / (count_N - 1) * (rewards_N - mean_N)


def no_normalization(rewards_N: Tensor, group_index_N: Tensor, group_size: int | None = None) -> Tensor:
    """Identity: the raw reward (PPO, REINFORCE++, where a critic or global whitening does the centring)."""
    return rewards_N


Normalizer = Callable[[Tensor, Tensor, "int | None"], Tensor]

# To add a normalizer: write it above with this signature and register it here.
NORMALIZERS: dict[str, Normalizer] = {
    "group_mean_std": group_mean_std,
    "group_mean": group_mean,
    "leave_one_out": leave_one_out,
    "none": no_normalization,
}
