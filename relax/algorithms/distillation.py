r"""On-policy distillation: per-token divergence from the student :math:`\pi` to a teacher :math:`\pi_T`.

Only the log-probs of the SAMPLED tokens are available (sampled from the student), so each divergence
is a single-sample estimate under :math:`y_t \sim \pi`, with :math:`\rho_t = \pi_T(y_t)/\pi(y_t)`:

* reverse_kl :math:`KL(\pi\|\pi_T)`: :math:`-\log\rho` (the Thinking Machines / GKD per-token signal);
* forward_kl :math:`KL(\pi_T\|\pi)`: :math:`\rho\log\rho` (importance-weighted);
* jsd (beta = 1/2): :math:`\tfrac12\log\frac{2}{1+\rho} + \tfrac12\rho\log\frac{2\rho}{1+\rho}`.

Agarwal et al. 2024, GKD (arXiv:2306.13649); Lu & Thinking Machines 2025, "On-Policy Distillation".
Departure from GKD: GKD uses the full-vocabulary divergence; only sampled tokens are used here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relax.algorithms.masked import clamped_log_ratio


def _log_rho(log_probs: Tensor, teacher_log_probs: Tensor) -> Tensor:
    return clamped_log_ratio(teacher_log_probs.detach(), log_probs)


def reverse_kl(log_probs: Tensor, teacher_log_probs: Tensor) -> Tensor:
    r"""Per-token :math:`\log\pi(y_t) - \log\pi_T(y_t)`, [B, T]."""
    return -_log_rho(log_probs, teacher_log_probs)


def forward_kl(log_probs: Tensor, teacher_log_probs: Tensor) -> Tensor:
    r"""Per-token :math:`\rho\log\rho`, :math:`\rho = \pi_T/\pi`, [B, T]."""
    log_rho = _log_rho(log_probs, teacher_log_probs)
    return torch.exp(log_rho) * log_rho


def jsd(log_probs: Tensor, teacher_log_probs: Tensor) -> Tensor:
    r"""Per-token :math:`\tfrac12\log\frac{2}{1+\rho} + \tfrac12\rho\log\frac{2\rho}{1+\rho}`, [B, T]."""
    log_rho = _log_rho(log_probs, teacher_log_probs)
    log_1p_rho = torch.nn.functional.softplus(log_rho)  # log(1 + rho), stable
    rho = torch.exp(log_rho)
    return 0.5 * (math.log(2) - log_1p_rho) + 0.5 * rho * (math.log(2) + log_rho - log_1p_rho)


DIVERGENCES = {"reverse_kl": reverse_kl, "forward_kl": forward_kl, "jsd": jsd}


def distillation_divergence(log_probs: Tensor, teacher_log_probs: Tensor, divergence: str) -> Tensor:
    """Per-token divergence by name; unknown names raise listing the valid ones."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown distillation divergence {divergence!r}; valid: {', '.join(DIVERGENCES)}")
    return DIVERGENCES[divergence](log_probs, teacher_log_probs)


def distillation_advantages(
    log_probs: Tensor, teacher_log_probs: Tensor, mask: Tensor, coef: float, divergence: str = "reverse_kl"
) -> Tensor:
    r"""Advantage term :math:`\hat A_t = -c\,D_t` (detached), per token with no discount, [B, T].

    Thinking Machines 2025: the negative per-token reverse KL to the teacher is the advantage.
    """
    return -coef * distillation_divergence(log_probs.detach(), teacher_log_probs, divergence) * mask


def distillation_loss(
    log_probs: Tensor, teacher_log_probs: Tensor, coef: float, divergence: str = "reverse_kl"
) -> Tensor:
    r"""Loss term :math:`c\,\tilde D_t`, [B, T], with gradient through ``log_probs`` only.

    For reverse_kl the surrogate is :math:`\tfrac12(\log\pi - \log\pi_T)^2` (k2), whose on-policy
    gradient :math:`E_\pi[(\log\pi-\log\pi_T)\nabla\log\pi]` is exactly :math:`\nabla KL(\pi\|\pi_T)`
    (the plain estimate :math:`\log\pi-\log\pi_T` has zero expected gradient through the score).
    forward_kl and jsd use their estimates above directly (a departure: plug-in gradients).
    """
    if divergence == "reverse_kl":
        return coef * 0.5 * _log_rho(log_probs, teacher_log_probs) ** 2
    return coef * distillation_divergence(log_probs, teacher_log_probs, divergence)
