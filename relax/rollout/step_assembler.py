r"""Which training step a finished prompt group goes to (`rollout.batch_order`).

``step`` (the default): a group trains in the step that drew its prompt, so a step's data is complete
only when its slowest response ends. ``completion``: a finished group goes to the oldest started step
that still lacks groups, whichever step drew its prompt. With steps running ahead (hybrid,
fully_async), a step then fills with the first ``prompts_per_step`` groups to finish among everything in
flight, and a long response is trained by a later step instead of holding its own back: the step costs
the engines' throughput, not its longest response (the over-provisioned, first-finished batching of
AReaL and of slime's partial rollout).

Counting. Every started step's producer writes exactly its quota of groups (``quota()``) and every
started step takes exactly ``prompts_per_step``; without over-provisioning the two match, so when a
group finishes some started step always has room, and each step gets its full count.

Over-provisioning (``rollout.over_provision: k``; completion order, streaming modes). The first step
started draws ``prompts_per_step + k`` prompts and every later one ``prompts_per_step``, so k groups
more than the started steps take are always in flight: a step is complete when the fastest
``prompts_per_step`` of its candidates finish, not when its slowest one does, and the engines keep
decoding the surplus while the gate holds the next step back. A surplus group that finishes while every
started step is full waits here and goes to the next step that starts. With partial rollout the surplus
continues across weight updates like any in-flight group (slime's over-sampling, AReaL's
over-provisioned batches). The run's last k groups are left untrained.

Staleness. The gate (relax/rollout/staleness.py) still bounds how far *starting* a step runs
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
from relax.rollout.metrics import rollout_metrics

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

    def __init__(self, want: int, order: BatchOrder, write: Write, over_provision: int = 0) -> None:
        if order not in ("step", "completion"):
            raise ValueError(f"rollout.batch_order must be 'step' or 'completion', got {order!r}")
        if over_provision and order != "completion":
            raise ValueError("rollout.over_provision needs rollout.batch_order=completion")
        self.want, self.order, self.write = want, order, write
        self.over_provision = over_provision
        self.steps: dict[int, _Step] = {}
        self._quotas = 0  # producers given their quota
        self._waiting: list[
            asyncio.Future[int]
        ] = []  # surplus groups that finished while every step was full

    def quota(self) -> int:
        """How many groups the next producer draws and writes: `want`, and `over_provision` more for the
        first one."""
        self._quotas += 1
        return self.want + (self.over_provision if self._quotas == 1 else 0)

    def open(self, step: int) -> None:
        """Step `step` started: it takes `want` groups, first the surplus groups waiting for a step."""
        st = self.steps.setdefault(step, _Step())
        while self._waiting and st.assigned < self.want:
            waiting = self._waiting.pop(0)
            if not waiting.done():  # done: its producer was cancelled
                st.assigned += 1  # the slot is taken now; `put` completes the write
                waiting.set_result(step)

    def _target(self, origin: int) -> int | None:
        if self.order == "step":
            return origin
        return min((s for s, st in self.steps.items() if st.assigned < self.want), default=None)

    async def put(self, origin: int, group: list[Sample], stats: Any) -> int:
        """Write one finished group of step `origin`'s producer; returns the step it went to. A surplus
        group that finds every started step full waits for the next step to start."""
        target = self._target(origin)
        if target is None:
            waiting = asyncio.get_running_loop().create_future()
            self._waiting.append(waiting)
            target = await waiting
            self.steps[target].assigned -= 1  # `open` took the slot; counted once more below
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
