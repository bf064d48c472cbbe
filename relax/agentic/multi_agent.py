"""Multi-agent samples: one sample, several contexts (e.g. a planner's and a worker's conversation), each
exported as its own training row, with a user-defined function sharing the credit among them.

`rollout.agent.contexts_per_sample = C` and `rollout.agent.advantage_fn = "package.module:fn"`::

    def fn(samples: list[Sample]) -> list[list[float]]:
        # samples: one prompt group, scored (sample.reward is the outcome reward); each sample's
        # contexts are [sample, *sample.contexts]. Return, per sample, C numbers, one per context.

Each context's number becomes its row's reward (the scalar the algorithm's advantage estimator turns
into token advantages; with GRPO it is normalised among the group's rows of the same context slot,
since context c of group g gets row group id g * C + c). The outcome reward stays in
`reward_info["outcome_reward"]`.

A sample with fewer than C contexts (an agent that skipped a role) gets filler contexts: its prompt and
one end-of-turn token with loss mask 0, which train nothing.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

from relax.data.sample import Sample, SampleStatus

AdvantageFn = Callable[[list[Sample]], list[list[float]]]


def load_advantage_fn(path: str) -> AdvantageFn:
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"rollout.agent.advantage_fn must be package.module:function, got {path!r}")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import rollout.agent.advantage_fn {path!r}: {e}") from e
    return fn


def pad_contexts(sample: Sample, contexts_per_sample: int, filler_token: int) -> None:
    """Give `sample` exactly C - 1 further contexts (fillers train nothing)."""
    while len(sample.contexts) < contexts_per_sample - 1:
        sample.contexts.append(
            Sample(
                index=sample.index,
                prompt=sample.prompt,
                label=sample.label,
                metadata=sample.metadata,
                prompt_ids=list(sample.prompt_ids),
                group_id=sample.group_id,
                sample_id=sample.sample_id,
                response_ids=[filler_token],
                loss_mask=[0],
                rollout_log_probs=[0.0],
                status=SampleStatus.FAILED,
                weight_versions=list(sample.weight_versions),
                termination="missing_context",
            )
        )
    del sample.contexts[contexts_per_sample - 1 :]


def apply_advantage_fn(fn: AdvantageFn, samples: list[Sample], contexts_per_sample: int) -> None:
    """Call the user's function on one scored group and give each context its value."""
    values = fn(samples)
    if not isinstance(values, (list, tuple)) or len(values) != len(samples):
        got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"advantage_fn must return one list per sample ({len(samples)}), got {got}")
    for s, per_ctx in zip(samples, values, strict=True):
        per_ctx = list(per_ctx)
        if len(per_ctx) != contexts_per_sample or not all(
            isinstance(v, (int, float)) and math.isfinite(v) for v in per_ctx
        ):
            raise ValueError(
                f"advantage_fn must return {contexts_per_sample} finite numbers per sample, got {per_ctx!r}"
            )
        s.reward_info = {**s.reward_info, "outcome_reward": float(s.reward or 0.0)}
        for ctx, v in zip([s, *s.contexts], per_ctx, strict=True):
            ctx.reward = float(v)
