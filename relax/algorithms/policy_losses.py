r"""Policy losses: per-token loss [B, T] (to be MINIMISED) and metrics, before aggregation.

Common notation: :math:`r_t = \pi_\theta(y_t)/\pi_{old}(y_t) = \exp(\log\pi_\theta - \log\pi_{old})`,
:math:`\hat A_t` the advantage. Only ``log_probs`` carries gradient; ``old_log_probs`` and
``advantages`` are detached here. Departure shared by all: the log-ratio is clamped to [-20, 20]
before ``exp`` so one wild token cannot overflow (no gradient flows through a clamped log-ratio).
Metrics are detached scalar tensors (means over the masked tokens handed in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from relax.algorithms.masked import clamped_log_ratio, masked_mean

Metrics = dict[str, Tensor]


def _log_ratio(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    return clamped_log_ratio(log_probs, old_log_probs.detach())


def ratio_metrics(ratio: Tensor, mask: Tensor) -> Metrics:
    """Mean/min/max of the ratio and the k1 approx-KL over masked tokens (0 when nothing is masked)."""
    ratio, m = ratio.detach(), mask.bool()
    if not bool(m.any()):
        zero = ratio.new_zeros(())
        return {"ratio_mean": zero, "ratio_min": zero, "ratio_max": zero, "approx_kl": zero}
    return {
        "ratio_mean": ratio[m].mean(),
        "ratio_min": ratio[m].min(),
        "ratio_max": ratio[m].max(),
        "approx_kl": -torch.log(ratio[m]).mean(),
    }


def ppo_clip_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, Metrics]:
    r"""PPO clipped surrogate with asymmetric bounds and dual clip.

    :math:`l_t = \max(-\hat A_t r_t,\ -\hat A_t\,\mathrm{clip}(r_t, 1-\epsilon_{low}, 1+\epsilon_{high}))`;
    with dual clip (Ye et al. 2020, arXiv:1912.09729) for :math:`\hat A_t < 0`:
    :math:`l_t = \min(l_t, -c\,\hat A_t)`. Schulman et al. 2017 (arXiv:1707.06347); clip-higher
    :math:`\epsilon_{high} > \epsilon_{low}` from DAPO (arXiv:2503.14476). No other departure.
    """
    adv = advantages.detach()
    ratio = torch.exp(_log_ratio(log_probs, old_log_probs))
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(pg_unclipped, pg_clipped)
    metrics = {"clip_frac": masked_mean((pg_clipped > pg_unclipped).float(), mask)}
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        metrics["dual_clip_frac"] = masked_mean(dual.float(), mask)
    return loss, {**metrics, **ratio_metrics(ratio, mask)}


def gspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[Tensor, Metrics]:
    r"""GSPO: clip a sequence-level ratio, the geometric mean of the token ratios.

    :math:`s_i = \exp(\frac{1}{|y_i|}\sum_t \log r_{i,t})`, loss per sequence
    :math:`\max(-\hat A_i s_i, -\hat A_i\,\mathrm{clip}(s_i, 1-\epsilon_{low}, 1+\epsilon_{high}))`.
    Zheng et al. 2025 (arXiv:2507.18071). Written in the paper's GSPO-token form,
    :math:`s_{i,t} = \mathrm{sg}[s_i]\,\pi_\theta(y_t)/\mathrm{sg}[\pi_\theta(y_t)]`, whose value equals
    :math:`s_i` and whose gradient equals GSPO's when :math:`\hat A_{i,t} = \hat A_i`; aggregate with
    seq_mean_token_mean to recover the paper's objective exactly.
    """
    adv = advantages.detach()
    seq_log_ratio_B = masked_mean(_log_ratio(log_probs, old_log_probs).detach(), mask, dim=-1)
    log_s = log_probs - log_probs.detach() + seq_log_ratio_B.unsqueeze(-1)  # [B, T], value = seq ratio
    s = torch.exp(log_s)
    pg_unclipped = -adv * s
    pg_clipped = -adv * s.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(pg_unclipped, pg_clipped)
    metrics = {"clip_frac": masked_mean((pg_clipped > pg_unclipped).float(), mask)}
    token_ratio = torch.exp(_log_ratio(log_probs, old_log_probs))
    return loss, {
        **metrics,
        **ratio_metrics(token_ratio, mask),
        "seq_ratio_mean": masked_mean(s.detach(), mask),
    }


def sapo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, Metrics]:
    r"""SAPO: a soft sigmoid gate in place of the hard clip.

    :math:`l_t = -f_\tau(r_t)\,\hat A_t`, :math:`f_\tau(r) = \frac{4}{\tau}\sigma(\tau(r-1))`, with
    :math:`\tau = \tau_{pos}` if :math:`\hat A_t > 0` else :math:`\tau_{neg}`. The gradient weight
    :math:`4\sigma(1-\sigma)` is 1 at :math:`r = 1` and decays smoothly off-policy.
    Gao et al. 2025, Soft Adaptive Policy Optimization (Qwen). No departure.
    """
    adv = advantages.detach()
    ratio = torch.exp(_log_ratio(log_probs, old_log_probs))
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    loss = -gate * adv
    sig = torch.sigmoid(tau * (ratio - 1)).detach()
    metrics = {"gate_grad_weight": masked_mean(4 * sig * (1 - sig), mask)}
    return loss, {**metrics, **ratio_metrics(ratio, mask)}


def cispo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 1.0,
    clip_high: float = 4.0,
) -> tuple[Tensor, Metrics]:
    r"""CISPO: clip the importance weight, never the gradient.

    :math:`l_t = -\mathrm{sg}[\mathrm{clip}(r_t, 1-\epsilon_{low}, 1+\epsilon_{high})]\,\hat A_t\,\log\pi_\theta(y_t)`.
    MiniMax-M1 (arXiv:2506.13585), eq. 4: every token keeps a gradient, scaled by the bounded weight.
    The loss VALUE is a surrogate (only its gradient is meaningful). The paper leaves the lower bound
    off; ``clip_low = 1`` (weight >= 0) reproduces that.
    """
    adv = advantages.detach()
    ratio = torch.exp(_log_ratio(log_probs, old_log_probs))
    weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()
    loss = -weight * adv * log_probs
    clipped = (ratio.detach() < 1 - clip_low) | (ratio.detach() > 1 + clip_high)
    return loss, {"clip_frac": masked_mean(clipped.float(), mask), **ratio_metrics(ratio, mask)}


def reinforce_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Metrics]:
    r"""REINFORCE / RLOO: unclipped importance-weighted policy gradient, :math:`l_t = -r_t \hat A_t`.

    On-policy (:math:`r = 1`) its gradient is :math:`-\hat A_t\nabla\log\pi_\theta(y_t)`, the
    REINFORCE estimator of Ahmadian et al. 2024 (arXiv:2402.14740). No trust region: on-policy only.
    """
    ratio = torch.exp(_log_ratio(log_probs, old_log_probs))
    return -ratio * advantages.detach(), ratio_metrics(ratio, mask)


def m2po_mask(log_ratio: Tensor, advantages: Tensor, mask: Tensor, tau: float) -> Tensor:
    r"""M2PO's second-moment trust mask, [B, T] float.

    Among the masked tokens where a PPO clip could act (:math:`\hat A > 0, r > 1` or
    :math:`\hat A < 0, r < 1`), drop those with the largest :math:`(\log r)^2` until the mean
    :math:`(\log r)^2` of the remaining ones is at most :math:`\tau_{M_2}`.
    """
    lr, adv = log_ratio.detach(), advantages.detach()
    candidate = mask.bool() & (((adv > 0) & (lr > 0)) | ((adv < 0) & (lr < 0)))
    keep = mask.bool().clone()
    idx = torch.nonzero(candidate.reshape(-1)).squeeze(-1)
    m2 = lr.reshape(-1)[idx].double() ** 2
    if m2.numel() and float(m2.mean()) > tau:
        sorted_m2, order = torch.sort(m2)
        prefix_mean = sorted_m2.cumsum(0) / torch.arange(1, len(m2) + 1, device=m2.device)
        n_keep = int((prefix_mean <= tau).sum())
        keep.view(-1)[idx[order[n_keep:]]] = False
    return keep.to(mask.dtype)


def m2po_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, tau: float = 0.04
) -> tuple[Tensor, Metrics]:
    r"""M2PO: unclipped :math:`-M_t r_t \hat A_t` where the mask :math:`M` bounds the second moment.

    Zheng, Zhao, Chen 2025, Prosperity before Collapse (arXiv:2510.01161): replaces PPO's per-token
    clip by a batch-level budget :math:`\frac1n\sum (\log r)^2 \le \tau_{M_2}` (adaptive clip bounds:
    only the extreme outliers are dropped). Departure: the budget is enforced per micro-batch, not
    over the global batch; dropped tokens still count in the aggregation denominator (paper fn. 2).
    """
    log_ratio = _log_ratio(log_probs, old_log_probs)
    keep = m2po_mask(log_ratio, advantages, mask, tau)
    ratio = torch.exp(log_ratio)
    loss = -ratio * advantages.detach() * keep
    metrics = {
        "m2po_masked_frac": masked_mean(1 - keep, mask),
        "m2po_m2_before": masked_mean(log_ratio.detach() ** 2, mask),
        "m2po_m2_after": masked_mean(log_ratio.detach() ** 2, keep),
    }
    return loss, {**metrics, **ratio_metrics(ratio, mask)}


PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, Any], "tuple[Tensor, Metrics]"]

# To add a policy loss: write it above and register an adapter here reading its parameters from
# the AlgorithmConfig (``c``); the registry names it in an AlgorithmSpec.
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": lambda lp, old, a, m, c: ppo_clip_loss(
        lp, old, a, m, c.clip_eps_low, c.clip_eps_high, c.dual_clip_c
    ),
    "gspo": lambda lp, old, a, m, c: gspo_loss(lp, old, a, m, c.clip_eps_low, c.clip_eps_high),
    "sapo": lambda lp, old, a, m, c: sapo_loss(lp, old, a, m, c.sapo_tau_pos, c.sapo_tau_neg),
    "cispo": lambda lp, old, a, m, c: cispo_loss(lp, old, a, m, c.clip_eps_low, c.clip_eps_high),
    "reinforce": lambda lp, old, a, m, c: reinforce_loss(lp, old, a, m),
    "m2po": lambda lp, old, a, m, c: m2po_loss(lp, old, a, m, c.m2po_tau),
}
