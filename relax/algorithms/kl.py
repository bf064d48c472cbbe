r"""KL estimators between the current policy :math:`\pi` and a reference :math:`\pi_{ref}`, per token.

Each takes the log-probs of the SAMPLED tokens (samples drawn from :math:`\pi`) and returns a [B, T]
estimate of :math:`KL(\pi \| \pi_{ref})` at that token (Schulman 2020, "Approximating KL divergence"):
with :math:`\log\rho = \log\pi_{ref} - \log\pi`,

* k1 = :math:`-\log\rho` (unbiased, high variance, can be negative);
* k2 = :math:`\tfrac12(\log\rho)^2` (biased, low variance; its gradient on-policy is the exact
  gradient of the reverse KL);
* k3 = :math:`(\rho - 1) - \log\rho` (unbiased, non-negative; used as a loss, its gradient is that of
  the forward KL :math:`KL(\pi_{ref}\|\pi)` -- the known departure of GRPO's KL term);
* low_var_kl = k3 with :math:`\log\rho` clamped to [-20, 20] and the result to [-10, 10] (verl).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    r""":math:`k_1 = \log\pi - \log\pi_{ref}`."""
    return log_probs - ref_log_probs


def kl_k2(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    r""":math:`k_2 = \tfrac12(\log\pi - \log\pi_{ref})^2`."""
    return 0.5 * (log_probs - ref_log_probs) ** 2


def kl_k3(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    r""":math:`k_3 = e^{\log\pi_{ref}-\log\pi} - 1 - (\log\pi_{ref} - \log\pi)` (GRPO's KL term)."""
    log_rho = ref_log_probs - log_probs
    return torch.exp(log_rho) - 1 - log_rho


def kl_low_var(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k3 with the log-ratio clamped to [-20, 20] and the estimate to [-10, 10] (verl's low_var_kl)."""
    log_rho = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (torch.exp(log_rho) - 1 - log_rho).clamp(-10.0, 10.0)


KLFn = Callable[[Tensor, Tensor], Tensor]

# To add an estimator: write it above and register it here (and in config.KLEstimator).
KL_ESTIMATORS: dict[str, KLFn] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "low_var_kl": kl_low_var}


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate [B, T] by estimator name; unknown names raise listing the valid ones."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](log_probs, ref_log_probs)


def reward_kl_shaping(log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor, coef: float) -> Tensor:
    r"""Reward-side KL: per-token reward :math:`-\beta\,k_1 = -\beta(\log\pi_{old} - \log\pi_{ref})`, [B, T].

    InstructGPT (Ouyang et al. 2022) / REINFORCE++: the KL enters the return, not the loss; no gradient
    flows through it (inputs are detached).
    """
    return -coef * kl_k1(log_probs.detach(), ref_log_probs.detach()) * mask
