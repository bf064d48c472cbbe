"""Masked reductions over [B, T] tensors (mask: float 0/1, 0 on padding and environment tokens), and the
one clamp every log-ratio of the algorithms goes through."""

from __future__ import annotations

import torch
from torch import Tensor

# A log-ratio of two log-probs is clamped to [-20, 20] before it is exponentiated: exp(20) ~ 5e8 still
# ranks every ratio a clip or mask compares, and keeps exp (and its gradient) finite for tokens whose
# probabilities moved apart by more than float32 can hold.
LOG_RATIO_CLAMP = 20.0


def clamped_log_ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """`numerator - denominator` (log-probs) clamped to +-LOG_RATIO_CLAMP."""
    return (numerator - denominator).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is 1 (masked entries may hold inf/NaN: they are zeroed, not multiplied)."""
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked entries; 0 where nothing is masked in (never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Unbiased variance of ``x`` over masked entries (0 with fewer than 2 entries)."""
    n = mask.sum()
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    return sq / (n - 1).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    r"""Whiten over masked entries: :math:`(x - \mu) / \sqrt{\sigma^2 + \epsilon}`, 0 outside the mask.

    :math:`\mu, \sigma^2` are the masked mean and unbiased variance over the whole tensor (a global
    statistic over every token handed in). With ``shift_mean=False`` the mean is added back.
    """
    mean = masked_mean(x, mask)
    out = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))
