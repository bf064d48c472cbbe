"""DAPO's data-side pieces: dynamic sampling and overlong reward shaping (Yu et al. 2025, arXiv:2503.14476).

The loss-side pieces of DAPO are config options: clip-higher (``clip_eps_high``) and the token-level
loss (``loss_agg_mode='token_mean'``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def filter_groups_dynamic_sampling(rewards_N: Tensor, group_index_N: Tensor) -> Tensor:
    r"""Dynamic sampling: keep_N is False for every sample of a group whose rewards all agree.

    DAPO eq. 11 constraint :math:`0 < |\{o_i \text{ correct}\}| < G`, generalised to any reward:
    such a group has zero advantage under group normalisation and only dilutes the batch. The rollout
    over-samples prompts and refills the batch with kept groups. Returns a bool tensor [N].
    """
    _, inverse_N = torch.unique(group_index_N, return_inverse=True)
    num_groups = int(inverse_N.max()) + 1 if inverse_N.numel() else 0
    r = rewards_N.double()
    max_G = torch.full((num_groups,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(
        0, inverse_N, r, reduce="amax"
    )
    min_G = torch.full((num_groups,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(
        0, inverse_N, r, reduce="amin"
    )
    return (max_G > min_G)[inverse_N]


def overlong_penalty(response_lengths_N: Tensor, max_len: int, buffer_len: int, penalty: float) -> Tensor:
    r"""Soft overlong punishment (DAPO eq. 13), the term ADDED to the reward, [N]:

    .. math:: R(y) = \begin{cases} 0 & |y| \le L_{max} - L_{buf} \\
              \frac{(L_{max} - L_{buf}) - |y|}{L_{buf}}\,p & L_{max} - L_{buf} < |y| \le L_{max} \\
              -p & |y| > L_{max} \end{cases}

    with :math:`p` the penalty factor (the paper uses :math:`p = 1`). ``buffer_len = 0`` gives zeros.
    """
    if buffer_len <= 0:
        return torch.zeros_like(response_lengths_N, dtype=torch.float32)
    if buffer_len > max_len:
        raise ValueError(f"overlong_buffer_len={buffer_len} exceeds the max response length {max_len}")
    lengths = response_lengths_N.float()
    expected = max_len - buffer_len
    ramp = (expected - lengths) / buffer_len * penalty
    return torch.where(lengths > max_len, torch.full_like(ramp, -penalty), ramp.clamp(max=0.0))
