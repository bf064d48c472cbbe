"""The Rollout's account of its steps: for each step, the data position before its prompts were drawn,
where its prompt groups went (`rollout.batch_order: completion` sends a group to the oldest step still
short of groups), whether its producer finished, its own metrics, and how far ahead of training it
started; and the last step whose weights the engines hold.

From that it answers: is step s ready to train (`ready`), what are its rollout metrics (`collect`), and
which data position a checkpoint must record (`data_position`): that of the oldest step whose groups
are not all written and trained, so a resume draws again exactly the prompts not yet trained on.
"""

from __future__ import annotations

from typing import Any

from relax.rollout.step_assembler import StepAssembler


class StepLedger:
    def __init__(self, assembler: StepAssembler) -> None:
        self.assembler = assembler
        self.source_states: dict[int, dict] = {}  # step -> prompt position before it was drawn
        self.targets: dict[int, set[int]] = {}  # producer step -> steps its groups went to
        self.produced: dict[int, dict[str, float]] = {}  # finished producer step -> its own metrics
        self.finished: set[int] = set()  # steps whose producer wrote all its groups
        self.ahead: dict[int, int] = {}  # step -> steps ahead of training when it started
        self.trained = 0  # last training step whose weights the engines hold

    def open(self, step: int, source_state: dict) -> None:
        """Step `step` draws its prompts now, from data position `source_state`."""
        self.source_states[step] = source_state
        self.targets[step] = set()
        self.assembler.open(step)

    def wrote(self, step: int, target: int) -> None:
        """A group drawn by step `step` was written to step `target`'s partition."""
        self.targets[step].add(target)

    def finish(self, step: int, metrics: dict[str, float]) -> None:
        """Step `step`'s producer wrote all its groups; `metrics` are its own."""
        self.produced[step] = metrics
        self.finished.add(step)

    def ready(self, step: int) -> bool:
        """Step `step`'s data is complete (its producer's, or in completion order its quota of groups)."""
        if self.assembler.order == "step":
            return step in self.produced
        return self.assembler.is_complete(step)

    def collect(self, step: int, extra: dict[str, float] | None = None) -> dict[str, Any]:
        """Step order: the producer's metrics; completion order: metrics of the groups the step trains on,
        with the dynamic-sampling figures of the latest finished producer and `extra`. Both with how far
        ahead of training the step started."""
        if self.assembler.order == "step":
            self.assembler.steps.pop(step, None)
            metrics = self.produced.pop(step)
        else:
            metrics = self.assembler.collect(step)
            done = [s for s in self.produced if s <= step]
            if done:
                latest = self.produced[max(done)]
                metrics.update({k: v for k, v in latest.items() if k.startswith("rollout/ds_")})
                for s in done:
                    self.produced.pop(s)
            metrics.update(extra or {})
        metrics["staleness/rollout_ahead"] = float(self.ahead.pop(step, 0))
        return metrics

    def mark_trained(self, step: int) -> None:
        """The engines now hold the weights trained through `step`; forget steps wholly trained."""
        self.trained = step
        for s in [s for s in self.source_states if self.settled(s)]:
            self.source_states.pop(s)
            self.targets.pop(s, None)
            self.finished.discard(s)

    def settled(self, step: int) -> bool:
        """Every group step `step`'s producer drew is written and trained."""
        targets = self.targets.get(step)
        return step in self.finished and max(targets or {step}) <= self.trained

    def data_position(self, current: dict) -> dict:
        """The data position a checkpoint records: before the oldest step not wholly trained (prompts
        of steps generated ahead are drawn again on resume), else `current`."""
        pending = [s for s in self.source_states if not self.settled(s)]
        return self.source_states[min(pending)] if pending else current
