"""A step's rollout metrics: rewards, lengths, staleness, and the `agent/*` metrics of multi-turn or
external-agent episodes."""

from __future__ import annotations

import statistics
from collections import Counter

from relax.data.sample import Sample, SampleStatus


def agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """`agent/*` metrics of a step's episodes (empty when none is multi-turn or external)."""
    episodes = [s for s in samples if s.turns or s.termination]
    if not episodes:
        return {}
    calls = [sum(len(t.get("tool_calls", [])) for t in s.turns) for s in episodes]
    results = [r for s in episodes for t in s.turns for r in t.get("results", [])]
    model_tokens = [sum(s.loss_mask) for s in episodes]
    metrics = {
        "agent/turns_mean": statistics.fmean(len(s.turns) for s in episodes),
        "agent/tool_calls_mean": statistics.fmean(calls),
        "agent/tool_use_rate": statistics.fmean(c > 0 for c in calls),
        "agent/model_token_frac": statistics.fmean(
            m / max(1, s.response_length) for m, s in zip(model_tokens, episodes, strict=True)
        ),
        "agent/contexts_mean": statistics.fmean(1 + len(s.contexts) for s in episodes),
    }
    if results:
        metrics["agent/tool_error_rate"] = statistics.fmean(not r["ok"] for r in results)
        metrics["agent/tool_timeout_rate"] = statistics.fmean(r["error"] == "timeout" for r in results)
    for reason, count in Counter(s.termination for s in episodes).items():
        metrics[f"agent/termination/{reason}"] = count / len(episodes)
    return metrics


def rollout_metrics(samples: list[Sample], step: int) -> dict[str, float]:
    rewards = [float(s.reward or 0.0) for s in samples]
    lengths = [s.response_length for s in samples]
    versions = [s.weight_version for s in samples if s.weight_version >= 0] or [step - 1]
    return {
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/response_len_mean": statistics.fmean(lengths),
        "rollout/prompt_len_mean": statistics.fmean(len(s.prompt_ids) for s in samples),
        "rollout/response_len_max": float(max(lengths)),
        "rollout/truncated_frac": statistics.fmean(s.status == SampleStatus.TRUNCATED for s in samples),
        "rollout/num_samples": float(len(samples)),
        # staleness: how many updates the trainer is ahead of the weights that generated a sample
        "rollout/staleness_max": float(max(step - 1 - v for v in versions)),
        **agent_metrics(samples),
    }
