"""One training step's rollout, streamed: prompt groups are generated concurrently and each finished,
scored group is handed to a sink (the data plane) at once, so downstream roles start before the step's
slowest sample ends. Hand-overs run concurrently: a group that finishes while an earlier group's write is
in flight does not wait for it (the Rollout's `RowWriter` then sends them out together). Awaiting each
write in turn put one data-plane round trip per group on the step's critical path, most of a step's
rollout time on a small host (docs/measurements.md).

Dynamic sampling (DAPO, `algorithm.dynamic_sampling`) filters as groups finish: a group whose rewards
all agree (`filter_groups_dynamic_sampling`) is held back, and further rounds draw fresh prompts until
`prompts_per_step` kept groups are written or `dynamic_sampling_max_rounds` rounds are spent; then held
back groups fill the rest, so every step has exactly `prompts_per_step` groups in every mode.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from relax.algorithms.pipeline import filter_groups_dynamic_sampling
from relax.config import RelaxConfig
from relax.data.dataset import PromptRow, PromptSource
from relax.data.sample import Sample
from relax.rollout.loop import RolloutLoop
from relax.rollout.metrics import rollout_metrics

logger = logging.getLogger(__name__)

GroupSink = Callable[[list[Sample], Any], Awaitable[None]]  # a group and its RewardStats


def group_is_informative(samples: list[Sample]) -> bool:
    """Dynamic sampling's test on one group: do its rewards differ?"""
    rewards = torch.tensor([float(s.reward or 0.0) for s in samples])
    return bool(filter_groups_dynamic_sampling(rewards, torch.zeros(len(samples), dtype=torch.long)).all())


class StepProducer:
    def __init__(self, cfg: RelaxConfig, loop: RolloutLoop, source: PromptSource) -> None:
        self.cfg = cfg
        self.loop = loop
        self.source = source

    async def _group(self, row: PromptRow, group_id: int) -> tuple[list[Sample], Any]:
        samples = await self.loop._generate_group(row, group_id, self.loop.sampling_params())
        for s in samples:
            if not s.response_text and s.response_ids:
                s.response_text = self.loop.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        stats = await self.loop.scorer.score(samples)
        self.loop.after_scoring(samples)
        return samples, stats

    async def produce(self, step: int, sink: GroupSink, quota: int | None = None) -> dict[str, float]:
        """Generate step `step`'s groups, writing each kept group through `sink`: `quota` of them
        (default `prompts_per_step`; more when the rollout over-provisions). Returns the metrics."""
        algo = self.cfg.algorithm
        want = quota or self.cfg.rollout.prompts_per_step
        rounds_max = algo.dynamic_sampling_max_rounds if algo.dynamic_sampling else 1
        r = self.cfg.rollout
        next_gid = step * (r.prompts_per_step + r.over_provision) * rounds_max  # unique across quotas
        written, rounds, informative = 0, 0, 0
        generated: list[Sample] = []
        held: list[tuple[list[Sample], Any]] = []
        step_stats: list = []  # per produce call: steps running ahead overlap
        writes = _Writes(sink)
        try:
            while written < want and rounds < rounds_max:
                rounds += 1
                rows = self.source.next_batch(want - written)
                tasks = [asyncio.ensure_future(self._group(r, next_gid + i)) for i, r in enumerate(rows)]
                next_gid += len(rows)
                try:
                    for fut in asyncio.as_completed(tasks):
                        group, group_stats = await fut
                        writes.raise_failed()
                        generated += group
                        step_stats.append(group_stats)
                        keep = not algo.dynamic_sampling or group_is_informative(group)
                        informative += int(keep)
                        if written < want and keep:
                            writes.start(group, group_stats)
                            written += 1
                        else:
                            held.append((group, group_stats))
                except BaseException:
                    for t in tasks:
                        t.cancel()
                    raise
            for group, group_stats in held[: want - written]:  # rounds exhausted: fill with the rest
                writes.start(group, group_stats)
                written += 1
            await writes.wait()
        except BaseException:
            writes.cancel()
            raise
        stats = step_stats[0]
        for more in step_stats[1:]:
            stats = stats.merge(more)
        metrics = {**rollout_metrics(generated, step), **stats.as_metrics()}
        if algo.dynamic_sampling:
            metrics["rollout/ds_rounds"] = float(rounds)
            metrics["rollout/ds_informative_frac"] = informative / max(
                1, len(generated) // self.cfg.rollout.n_samples_per_prompt
            )
        metrics["rollout/aborted_requests"] = float(self.loop.inflight.num_aborted)
        metrics["rollout/resumed_frac"] = statistics.fmean(len(s.weight_versions) > 1 for s in generated)
        return metrics


class _Writes:
    """The sink calls of one `produce`, running concurrently; the first failure is raised."""

    def __init__(self, sink: GroupSink) -> None:
        self.sink = sink
        self.tasks: list[asyncio.Task] = []

    def start(self, group: list[Sample], stats: Any) -> None:
        self.tasks.append(asyncio.ensure_future(self.sink(group, stats)))

    def raise_failed(self) -> None:
        for t in self.tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()

    async def wait(self) -> None:
        await asyncio.gather(*self.tasks)

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()
