"""The running batch's next decode step, as the scheduler (`scheduler.py`) keeps it between steps: its
inputs carried over from the last step (`DecodeBatch`), and a step launched but not yet read back
(`InflightStep`, CUDA's overlap of host and device work)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from relax.backends.inference.embedded.sampling.sampling import BatchSampler
from relax.backends.inference.embedded.scheduling.logit_rows import LogitRows
from relax.backends.inference.embedded.scheduling.sequence import Sequence


@dataclass
class DecodeBatch:
    """The next decode step's inputs for the running batch as it is: built when rows join or leave, then
    advanced by each step (its sampled tokens are the next inputs, one column further)."""

    tokens_B: Tensor  # next input token of each row (on the device)
    pos_B: Tensor  # cache column it is written to
    length: int  # columns attended: max(pos_B) + 1
    delta_B: Tensor | None  # rotary position minus cache column (multimodal models), else None
    sampler: BatchSampler  # the rows' sampling parameters
    special: LogitRows | None = None  # rows with grammars, logit biases or top log-probs; None: none
    cols: np.ndarray | None = None  # pos_B as the host knows it: the KV block each row needs next


@dataclass
class InflightStep:
    """A decode step launched but not yet read back: its rows in launch order and their sampled tokens
    (on the device), copied to `host` behind `event`."""

    seqs: list[Sequence]
    tokens_B: Tensor
    host: Tensor  # [2, B] float64: token ids, log-probs
    event: torch.cuda.Event | None

    def read(self) -> tuple[list[int], list[float]]:
        if self.event is not None:
            self.event.synchronize()
        tokens, logprobs = self.host.tolist()
        return [int(t) for t in tokens], logprobs
