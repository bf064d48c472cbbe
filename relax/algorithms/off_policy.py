r"""Off-policy corrections against the inference engine's behaviour log-probs :math:`\mu`.

The rollout engine samples with :math:`\mu` (its own kernels, maybe older weights); the trainer
recomputes :math:`\pi_{old}` and optimises :math:`\pi_\theta`. These functions correct or drop tokens
where :math:`\mu` and :math:`\pi_{old}` disagree. All outputs are detached (no gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax.algorithms.kl import kl_k3
from relax.algorithms.masked import clamped_log_ratio, masked_mean


def behaviour_ratio(old_log_probs: Tensor, rollout_log_probs: Tensor) -> Tensor:
    r""":math:`\pi_{old}(y_t)/\mu(y_t)`, detached, log-ratio clamped to [-20, 20]."""
    log_ratio = clamped_log_ratio(old_log_probs, rollout_log_probs).detach()
    return torch.exp(log_ratio)


def tis_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, low: float, high: float) -> Tensor:
    r"""Truncated importance sampling weight :math:`w_t = \mathrm{sg}[\mathrm{clip}(\pi_{old}/\mu, low, high)]`.

    The policy-gradient term of each token is multiplied by :math:`w_t`. Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training" (TIS); the paper clamps only
    above (``low = 0`` reproduces it).
    """
    return behaviour_ratio(old_log_probs, rollout_log_probs).clamp(low, high)


def icepop_mask(
    old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, low: float, high: float
) -> Tensor:
    r"""ICEPOP token mask: keep token t only if :math:`low \le \pi_{old}/\mu \le high`, [B, T].

    Ling team 2025, "Small leak can sink a great ship -- IcePop": tokens outside the band get no
    gradient (masked, not clamped). Masked tokens still count in the aggregation denominator.
    """
    ratio = behaviour_ratio(old_log_probs, rollout_log_probs)
    return mask * ((ratio >= low) & (ratio <= high)).to(mask.dtype)


def opsm_mask(
    log_probs: Tensor, rollout_log_probs: Tensor, advantages: Tensor, mask: Tensor, delta: float
) -> Tensor:
    r"""Off-policy sequence masking, [B, T]: drop sequence i when it is both bad and far off-policy.

    Drop i iff :math:`\hat A_i < 0` and :math:`\frac{1}{|y_i|}\sum_t \log\frac{\mu(y_t)}{\pi_\theta(y_t)} > \delta`.
    DeepSeek-AI 2025, DeepSeek-V3.2 report (off-policy sequence masking). Departure: :math:`\hat A_i` is
    the masked mean of the token advantages (they are equal for outcome-reward algorithms).
    """
    divergence_B = masked_mean((rollout_log_probs - log_probs).detach(), mask, dim=-1)
    seq_adv_B = masked_mean(advantages.detach(), mask, dim=-1)
    drop_B = (seq_adv_B < 0) & (divergence_B > delta)
    return mask * (~drop_B).unsqueeze(-1).to(mask.dtype)


def mismatch_metrics(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    r"""Train/rollout log-prob mismatch over masked tokens.

    ``mismatch_k3``: k3 estimate of :math:`KL(\mu\|\pi_{old})`; ``mismatch_abs_diff``: mean
    :math:`|\log\pi_{old} - \log\mu|`; ``mismatch_ratio_max``: max :math:`\pi_{old}/\mu`.
    """
    old, roll = old_log_probs.detach(), rollout_log_probs.detach()
    ratio = behaviour_ratio(old, roll)
    m = mask.bool()
    return {
        "mismatch_k3": masked_mean(kl_k3(roll, old), mask),
        "mismatch_abs_diff": masked_mean((old - roll).abs(), mask),
        "mismatch_ratio_max": ratio[m].max() if bool(m.any()) else ratio.new_zeros(()),
    }
