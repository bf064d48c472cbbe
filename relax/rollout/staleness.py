r"""Version and staleness in one place: how far rollout may run ahead of training, and how stale a
sample is.

The rule (docs/modes.md). Rollout step k (0-based: the k-th batch generated, consumed by training step
k + 1) may start only while

.. math:: k + 1 - o \le \text{max\_staleness}

where o is the oldest training step not yet consumed (1-based; a step is consumed once the Actor has
trained on it and pushed the resulting weights to the engines). In the Controller's 1-based step
numbering (step s = k + 1) the rule reads :math:`s - o \le \text{max\_staleness}`. When step s starts the
engines hold weights version o - 1, and step s is trained by weights version s - 1, so every sample's
staleness (trainer version at training - version that generated it) is at most ``max_staleness``.
``max_staleness = 0`` is on-policy: step s starts only after step s - 1 is trained and pushed.

A sample generated across weight updates (partial rollout) records every version; its staleness counts
from the oldest one.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Sequence

logger = logging.getLogger(__name__)


class StalenessGate:
    """The rollout-ahead rule as a small state machine the Rollout consults before each step."""

    def __init__(self, max_staleness: int, first_step: int = 1) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self.oldest_unconsumed = first_step  # o: training steps before it are trained and pushed
        self._changed: asyncio.Condition | None = None

    def may_start(self, step: int) -> bool:
        """Whether rollout step `step` (1-based) may start now: `step - o <= max_staleness`."""
        return self.ahead(step) <= self.max_staleness

    def ahead(self, step: int) -> int:
        """How many not-yet-consumed steps precede `step` (its staleness bound if it started now)."""
        return step - self.oldest_unconsumed

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def wait_until_may_start(self, step: int) -> int:
        """Block until `may_start(step)`; returns `ahead(step)` at that moment."""
        async with self._cond():
            await self._cond().wait_for(lambda: self.may_start(step))
            return self.ahead(step)

    async def mark_consumed(self, step: int) -> None:
        """Training step `step` is trained and its weights pushed: later rollout steps may start."""
        async with self._cond():
            self.oldest_unconsumed = max(self.oldest_unconsumed, step + 1)
            self._cond().notify_all()


def sample_staleness(trainer_version: int, weight_versions: Sequence[int]) -> int:
    """Updates between the oldest weights that generated a sample and the weights that train on it."""
    return trainer_version - min(weight_versions) if weight_versions else 0


def staleness_metrics(trainer_version: int, versions: Sequence[Sequence[int]]) -> dict[str, float]:
    """Per-step staleness of the batch the trainer (at `trainer_version`) is about to train on."""
    s = [sample_staleness(trainer_version, v) for v in versions] or [0]
    mixed = [len(set(v)) > 1 for v in versions] or [False]
    return {
        "staleness/max": float(max(s)),
        "staleness/mean": statistics.fmean(s),
        "staleness/mixed_version_frac": statistics.fmean(mixed),  # samples spanning a weight update
    }
