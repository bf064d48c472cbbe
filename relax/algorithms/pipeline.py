"""The two entry points the rest of Relax calls: ``compute_advantages`` and ``make_policy_loss``.

The controller calls ``compute_advantages`` once per global batch; the trainer is handed the function
from ``make_policy_loss`` (and ``make_value_loss`` for a critic) and knows nothing else of the
algorithm. Everything here only wires the pure functions named by the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from relax.algorithms.advantages import ESTIMATORS, TOKEN_REWARD_ESTIMATORS, EstimatorInputs
from relax.algorithms.aggregation import aggregate_loss, get_reducer
from relax.algorithms.config import AlgorithmConfig
from relax.algorithms.critic import clipped_value_loss
from relax.algorithms.dapo import filter_groups_dynamic_sampling, overlong_penalty
from relax.algorithms.distillation import distillation_advantages, distillation_divergence, distillation_loss
from relax.algorithms.kl import kl_penalty, reward_kl_shaping
from relax.algorithms.masked import masked_mean, masked_var
from relax.algorithms.normalizers import NORMALIZERS
from relax.algorithms.off_policy import icepop_mask, mismatch_metrics, opsm_mask, tis_weights
from relax.algorithms.policy_losses import POLICY_LOSSES

__all__ = [
    "AdvantageOutput",
    "PolicyLossInputs",
    "PolicyLossFn",
    "ValueLossInputs",
    "compute_advantages",
    "make_policy_loss",
    "make_value_loss",
    "filter_groups_dynamic_sampling",
    "overlong_penalty",
]


@dataclass
class AdvantageOutput:
    advantages_NT: Tensor  # per-token advantage, 0 outside the loss mask, [N, T]
    returns_NT: Tensor | None  # critic regression target (GAE) or return-to-go (REINFORCE++), else None
    metrics: dict[str, float] = field(default_factory=dict)  # plain floats for logging


def _to_floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """Detached scalar tensors -> floats with one device sync."""
    if not metrics:
        return {}
    device = next(iter(metrics.values())).device
    values = torch.stack([v.detach().float().reshape(()).to(device) for v in metrics.values()])
    return dict(zip(metrics, values.tolist(), strict=True))


def _detached(metrics: dict[str, Tensor]) -> dict[str, Tensor]:
    """Detached fp32 0-d tensors, left on the device (no sync)."""
    return {k: v.detach().float().reshape(()) for k, v in metrics.items()}


def _need(x: Tensor | None, what: str, why: str) -> Tensor:
    if x is None:
        raise ValueError(f"{why} needs {what}, but it was not passed")
    return x


def compute_advantages(
    cfg: AlgorithmConfig,
    rewards_N: Tensor,
    group_index_N: Tensor,
    loss_mask_NT: Tensor,
    *,
    log_probs_NT: Tensor | None = None,
    ref_log_probs_NT: Tensor | None = None,
    values_NT: Tensor | None = None,
    teacher_log_probs_NT: Tensor | None = None,
    group_size: int | None = None,
    response_lengths_N: Tensor | None = None,
    max_response_len: int | None = None,
) -> AdvantageOutput:
    """Advantages (and returns) of a whole global batch under ``cfg``; no gradient flows.

    ``log_probs_NT`` are the old/behaviour log-probs (needed for reward-side KL and distillation);
    ``teacher_log_probs_NT`` defaults to ``ref_log_probs_NT`` (the reference role serves the teacher).
    ``group_size``: when given, every group must have exactly this size. ``response_lengths_N`` and
    ``max_response_len`` are needed for overlong shaping (``overlong_buffer_len > 0``).
    """
    spec = cfg.spec
    mask = loss_mask_NT.float()
    rewards = rewards_N.detach().float()
    metrics: dict[str, float] = {"reward_mean": rewards.mean().item() if rewards.numel() else 0.0}
    if cfg.overlong_buffer_len > 0:
        lengths = _need(response_lengths_N, "response_lengths_N", "overlong shaping")
        if max_response_len is None:
            raise ValueError("overlong shaping needs max_response_len")
        shaping = overlong_penalty(
            lengths, max_response_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
        )
        rewards = rewards + shaping.to(rewards.device)
        metrics["overlong_penalty_mean"] = shaping.mean().item() if shaping.numel() else 0.0
    token_rewards = torch.zeros_like(mask)
    if cfg.reward_kl_coef > 0:
        why = "reward-side KL (reward_kl_coef > 0)"
        lp, ref = _need(log_probs_NT, "log_probs_NT", why), _need(ref_log_probs_NT, "ref_log_probs_NT", why)
        token_rewards = reward_kl_shaping(lp.float(), ref.float(), mask, cfg.reward_kl_coef)
        metrics["reward_kl"] = masked_mean(-token_rewards / cfg.reward_kl_coef, mask).item()
        if spec.advantage_estimator not in TOKEN_REWARD_ESTIMATORS:
            rewards = rewards + token_rewards.sum(-1)  # the KL enters the sequence reward
            token_rewards = torch.zeros_like(mask)
    normalizer = spec.reward_normalizer
    if normalizer == "group_mean_std" and not cfg.normalize_std:
        normalizer = "group_mean"
    scores = NORMALIZERS[normalizer](rewards, group_index_N, group_size)
    inputs = EstimatorInputs(
        scores, token_rewards, mask, values_NT, cfg.gamma, cfg.lam, cfg.whiten_advantages
    )
    advantages, returns = ESTIMATORS[spec.advantage_estimator](inputs)
    if cfg.distill_coef > 0 and cfg.distill_mode == "advantage":
        why = "on-policy distillation (distill_coef > 0)"
        teacher = teacher_log_probs_NT if teacher_log_probs_NT is not None else ref_log_probs_NT
        teacher = _need(teacher, "teacher_log_probs_NT (or ref_log_probs_NT)", why)
        lp = _need(log_probs_NT, "log_probs_NT", why)
        advantages = advantages + distillation_advantages(
            lp.float(), teacher.float(), mask, cfg.distill_coef, cfg.distill_divergence
        )
        metrics["distill_divergence"] = masked_mean(
            distillation_divergence(lp.float(), teacher.float(), cfg.distill_divergence), mask
        ).item()
    metrics["advantage_mean"] = masked_mean(advantages, mask).item()
    metrics["advantage_std"] = masked_var(advantages, mask).sqrt().item()
    if returns is not None:
        metrics["return_mean"] = masked_mean(returns, mask).item()
    return AdvantageOutput(advantages.detach(), None if returns is None else returns.detach(), metrics)


@dataclass
class PolicyLossInputs:
    """One micro-batch, [B, T] over response tokens. Fields without grad are detached by the loss."""

    log_probs: Tensor  # current policy log-probs of the sampled tokens, WITH grad
    old_log_probs: Tensor  # log-probs at the weights that produced the batch (trainer recompute)
    advantages: Tensor  # from compute_advantages
    loss_mask: Tensor  # float 0/1: 1 on trained response tokens
    rollout_log_probs: Tensor | None  # behaviour log-probs from the inference engine (TIS/ICEPOP/OPSM)
    ref_log_probs: Tensor | None  # reference log-probs (kl_coef > 0)
    entropy: Tensor | None  # per-token policy entropy, WITH grad (entropy_coef > 0)
    global_num_tokens: float  # masked tokens in the whole global batch (all ranks, all micro-batches)
    global_num_seqs: float  # sequences in the whole global batch
    max_response_len: int  # max response length of the global batch (seq_mean_token_sum_norm)
    teacher_log_probs: Tensor | None = None  # teacher log-probs (distill_mode='loss'); else ref_log_probs


PolicyLossFn = Callable[[PolicyLossInputs], "tuple[Tensor, dict[str, float]]"]


def make_policy_loss(cfg: AlgorithmConfig, *, tensor_metrics: bool = False) -> PolicyLossFn:
    """The loss function the trainer calls per micro-batch.

    It returns (loss, metrics): ``loss`` is this micro-batch's SHARE of the global-batch loss --
    summing it over all micro-batches and ranks gives the global loss under ``cfg.loss_agg_mode``,
    so gradient accumulation (sum) + all-reduce (sum) equals one big batch. Metrics are floats, or with
    ``tensor_metrics`` detached 0-d tensors on the loss's device: the trainer reads a step's metrics
    from the device once, where a float per micro-batch would make the host wait for each forward.
    """
    finish = _detached if tensor_metrics else _to_floats
    policy_loss = POLICY_LOSSES[cfg.spec.policy_loss]
    get_reducer(cfg.loss_agg_mode, cfg.custom_loss_agg)  # fail now, not in the first step

    def loss_fn(x: PolicyLossInputs) -> tuple[Tensor, dict[str, float]]:
        mask = x.loss_mask.to(x.log_probs.dtype)
        pg_BT, metrics = policy_loss(x.log_probs, x.old_log_probs, x.advantages, mask, cfg)
        pg_mask = mask
        if cfg.tis or cfg.icepop or cfg.opsm:
            rollout = _need(x.rollout_log_probs, "rollout_log_probs", "tis/icepop/opsm")
            if cfg.tis:
                weight = tis_weights(x.old_log_probs, rollout, cfg.tis_clip_low, cfg.tis_clip_high)
                pg_BT = pg_BT * weight
                metrics["tis_weight_mean"] = masked_mean(weight, mask)
            if cfg.icepop:
                pg_mask = icepop_mask(x.old_log_probs, rollout, pg_mask, cfg.icepop_low, cfg.icepop_high)
            if cfg.opsm:
                pg_mask = opsm_mask(x.log_probs, rollout, x.advantages, pg_mask, cfg.opsm_delta)
            metrics["offpolicy_masked_frac"] = masked_mean(1 - pg_mask, mask)
        if x.rollout_log_probs is not None:
            metrics.update(mismatch_metrics(x.old_log_probs, x.rollout_log_probs, mask))
        total_BT = torch.where(pg_mask.bool(), pg_BT, torch.zeros_like(pg_BT))
        metrics["pg_loss"] = masked_mean(total_BT.detach(), mask)
        if cfg.kl_coef > 0:
            ref = _need(x.ref_log_probs, "ref_log_probs", "the KL loss (kl_coef > 0)")
            kl_BT = kl_penalty(x.log_probs, ref.detach(), cfg.kl_estimator)
            total_BT = total_BT + cfg.kl_coef * kl_BT
            metrics["kl_loss"] = masked_mean(kl_BT.detach(), mask)
        if cfg.entropy_coef > 0:
            entropy = _need(x.entropy, "entropy", "the entropy bonus (entropy_coef > 0)")
            total_BT = total_BT - cfg.entropy_coef * entropy
            metrics["entropy"] = masked_mean(entropy.detach(), mask)
        if cfg.distill_coef > 0 and cfg.distill_mode == "loss":
            teacher = x.teacher_log_probs if x.teacher_log_probs is not None else x.ref_log_probs
            teacher = _need(teacher, "teacher_log_probs (or ref_log_probs)", "distill_mode='loss'")
            d_BT = distillation_loss(x.log_probs, teacher, cfg.distill_coef, cfg.distill_divergence)
            total_BT = total_BT + d_BT
            metrics["distill_loss"] = masked_mean(d_BT.detach(), mask)
        loss = aggregate_loss(
            total_BT,
            mask,
            cfg.loss_agg_mode,
            global_num_tokens=x.global_num_tokens,
            global_num_seqs=x.global_num_seqs,
            max_response_len=x.max_response_len,
            custom_path=cfg.custom_loss_agg,
        )
        return loss, finish(metrics)

    return loss_fn


@dataclass
class ValueLossInputs:
    """One critic micro-batch, [B, T] over response tokens."""

    values: Tensor  # current critic values, WITH grad
    old_values: Tensor  # critic values when advantages were computed
    returns: Tensor  # AdvantageOutput.returns_NT
    loss_mask: Tensor  # float 0/1
    global_num_tokens: float  # as in PolicyLossInputs
    global_num_seqs: float
    max_response_len: int


def make_value_loss(
    cfg: AlgorithmConfig, *, tensor_metrics: bool = False
) -> Callable[[ValueLossInputs], tuple[Tensor, dict[str, float]]]:
    """The critic's per-micro-batch loss: clipped value loss, aggregated and scaled like the policy loss
    (``tensor_metrics`` as in `make_policy_loss`)."""
    get_reducer(cfg.loss_agg_mode, cfg.custom_loss_agg)
    finish = _detached if tensor_metrics else _to_floats

    def value_loss_fn(x: ValueLossInputs) -> tuple[Tensor, dict[str, float]]:
        mask = x.loss_mask.to(x.values.dtype)
        loss_BT, metrics = clipped_value_loss(x.values, x.old_values, x.returns, mask, cfg.value_clip)
        loss = cfg.value_loss_coef * aggregate_loss(
            loss_BT,
            mask,
            cfg.loss_agg_mode,
            global_num_tokens=x.global_num_tokens,
            global_num_seqs=x.global_num_seqs,
            max_response_len=x.max_response_len,
            custom_path=cfg.custom_loss_agg,
        )
        metrics["vf_loss"] = masked_mean(loss_BT.detach(), mask)
        return loss, finish(metrics)

    return value_loss_fn
