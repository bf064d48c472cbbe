"""What the fully_async stage roles (ActorFwd, Reference, Advantages) share: a background loop that fills
the role's column for one step after another from `start(first_step)`, a `metrics` call that raises that
loop's failure (the driver's check), and `stop`. A stage implements `process(step)`."""

from __future__ import annotations

import abc
import asyncio

from relax.config import RelaxConfig
from relax.dataplane.plane import PlaneClient
from relax.utils.tasks import cancel_and_wait


class StageRole(PlaneClient, abc.ABC):
    cfg: RelaxConfig
    _task: asyncio.Task | None = None

    @abc.abstractmethod
    async def process(self, step: int, timeout_s: float | None = None) -> None:
        """Write this role's columns for every row of step `step` (blocks until its inputs are there)."""

    async def start(self, first_step: int) -> None:
        self._task = asyncio.create_task(self._run(first_step))

    async def _run(self, step: int) -> None:
        while step <= self.cfg.trainer.num_steps:
            await self.process(step)
            step += 1

    async def metrics(self, step: int) -> dict[str, float]:
        """Raises the background loop's failure. A stage's step metrics travel with its rows (Advantages'
        `ADVANTAGES_METRICS` column), so this returns {}."""
        if self._task is not None and self._task.done() and self._task.exception() is not None:
            raise self._task.exception()
        return {}

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
