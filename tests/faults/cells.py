"""The cells of the fault matrix and what each promises: a cell is (fault, phase, mode, hosts); `expected`
gives the outcome the docs promise for it (docs/operations.md, docs/faults.md), `Result` what a run of
it showed. The toy run's size lives here too, since the promise counts its steps and samples."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

MODES = ("colocate", "hybrid", "fully_async")
STEPS, PROMPTS, SAMPLES, CKPT_EVERY = 6, 8, 4, 2
STOP_GRACE_S = 5.0
FINISH_S = 300.0  # from the fault to the end of a run that recovers (a global restart included)
REWARD_STALL_S = 20  # ops.step_timeout_s of the reward_stall cells


# -- cells and results ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """`fault`: kill:<engine|rollout|actor|actor_fwd|metrics|driver>, sigterm2, host_lost, disk_full,
    hung_reward (reward.timeout_s gives the fallback), reward_stall (ops.step_timeout_s names it),
    refused_group. `phase`: startup, rollout, push, update, eval, checkpoint, reward. `hosts`: one or
    cluster."""

    fault: str
    phase: str
    mode: str = "colocate"
    hosts: str = "one"

    @property
    def name(self) -> str:
        return f"{self.fault}@{self.phase}/{self.mode}/{self.hosts}"

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "-", self.name).strip("-")


@dataclass
class Expect:
    kind: str  # "finished" | "stopped" | "resumed"
    cause: str = ""  # stopped: a regex the run's output must hold
    bound_s: float = FINISH_S  # from the fault to the exit


def expected(cell: Cell) -> Expect:
    """What the docs promise for the cell (docs/operations.md)."""
    if cell.fault == "kill:driver":
        return Expect("resumed", bound_s=60)
    if cell.fault == "sigterm2":  # the second signal stops at once; the done-when: grace + 10 s
        return Expect("stopped", r"SIGTERM again: stopping now", STOP_GRACE_S + 10)
    if cell.fault == "disk_full":
        return Expect("stopped", r"No space left on device", 120)
    if cell.fault == "reward_stall":
        return Expect("stopped", r"stalled: \w+ did not finish", REWARD_STALL_S + 60)
    return Expect("finished")


@dataclass
class Result:
    cell: Cell
    outcome: str  # "finished, exact steps" | "stopped, named cause" | "resumed, exact steps" | "FAILS: ..."
    recover_s: float | None = None  # fault -> first step logged after it (finished), -> exit (stopped)
    steps: str = ""  # the steps in metrics.jsonl, e.g. "1-6"
    samples: str = ""  # samples trained / expected
    seconds: float = 0.0  # the whole cell
    notes: list[str] = field(default_factory=list)
    log: str = ""  # the run's output file
    injected: bool = True  # whether the fault was injected (a run may fail before)

    @property
    def ok(self) -> bool:
        return not self.outcome.startswith("FAILS")

    def to_json(self) -> dict:
        out = asdict(self)
        out["cell"] = {**asdict(self.cell), "name": self.cell.name}
        return out


class CellFailed(Exception):
    """The cell's outcome differs from the promise; the message says how."""


def span(steps: list[int]) -> str:
    if not steps:
        return "none"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])
    return ",".join(map(str, steps))
