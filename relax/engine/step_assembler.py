r"""Which training step a finished prompt group goes to (`rollout.batch_order`).

``step`` (the default): a group trains in the step that drew its prompt, so a step's data is complete
only when its slowest response ends. ``completion``: a finished group goes to the oldest started step
that still lacks groups, whichever step drew its prompt. With steps running ahead (hybrid,
fully_async), a step then fills with the first ``prompts_per_step`` groups to finish among everything in
flight, and a long response is trained by a later step instead of holding its own back: the step costs
the engines' throughput, not its longest response (the over-provisioned, first-finished batching of
AReaL and of slime's partial rollout).

Counting. Every started step's producer writes exactly ``prompts_per_step`` groups and every started
step takes exactly that many, so when a group finishes some started step always has room, and each
step gets its full count.

Staleness. The gate (relax/orchestration/staleness.py) still bounds how far *starting* a step runs
ahead. A group trained after its own step was trained for as many extra updates as it spent decoding;
``staleness/max`` reports it, partial rollout generates its later tokens under the newer weights, and
the off-policy corrections of the algorithm suite apply to it like to any stale sample.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from relax.data.sample import Sample
from relax.engine.rollout_loop import rollout_metrics

BatchOrder = Literal["step", "completion"]
Write = Callable[[int, list[Sample]], Awaitable[None]]


@dataclass
class _Step:
    assigned: int = 0  # groups routed here (a slot is taken before the write is awaited)
    written: int = 0
    samples: list[Sample] = field(default_factory=list)
    stats: Any = None  # merged RewardStats of its groups
    origins: set[int] = field(default_factory=set)  # steps whose producers drew its prompts
    carried: int = 0  # groups drawn by an earlier step's producer
    done: asyncio.Event = field(default_factory=asyncio.Event)


class StepAssembler:
    """Routes finished groups to steps and says when a step's data is complete."""

    def __init__(self, want: int, order: BatchOrder, write: Write) -> None:
        if order not in ("step", "completion"):
            raise ValueError(f"rollout.batch_order must be 'step' or 'completion', got {order!r}")
        self.want, self.order, self.write = want, order, write
        self.steps: dict[int, _Step] = {}

    def open(self, step: int) -> None:
        """Step `step` started: its producer will write `want` groups, and it takes `want`."""
        self.steps.setdefault(step, _Step())

    def _target(self, origin: int) -> int:
        if self.order == "step":
            return origin
        return min(s for s, st in self.steps.items() if st.assigned < self.want)

    async def put(self, origin: int, group: list[Sample], stats: Any) -> int:
        """Write one finished group of step `origin`'s producer; returns the step it went to."""
        target = self._target(origin)
        st = self.steps[target]
        st.assigned += 1
        st.origins.add(origin)
        st.carried += int(origin < target)
        await self.write(target, group)
        st.written += 1
        st.samples += group
        st.stats = stats if st.stats is None else st.stats.merge(stats)
        if st.written >= self.want:
            st.done.set()
        return target

    async def wait(self, step: int) -> None:
        await self.steps[step].done.wait()

    def is_complete(self, step: int) -> bool:
        st = self.steps.get(step)
        return st is not None and st.done.is_set()

    def collect(self, step: int) -> dict[str, float]:
        """A complete step's rollout metrics, computed on the groups it trains on; forgets the step."""
        st = self.steps.pop(step)
        metrics = {**rollout_metrics(st.samples, step), **(st.stats.as_metrics() if st.stats else {})}
        metrics["rollout/resumed_frac"] = statistics.fmean(len(s.weight_versions) > 1 for s in st.samples)
        metrics["rollout/carried_groups"] = float(st.carried)
        return metrics

    def origins(self, step: int) -> set[int]:
        st = self.steps.get(step)
        return set(st.origins) if st is not None else set()
