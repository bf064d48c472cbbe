"""The training-backend seam: what Actor, ActorFwd, Reference and Critic roles need from a trainer.

The in-process PyTorch backend implements it for one rank; a sharded backend (FSDP2 over several ranks,
or Megatron-LM) implements the same methods so the roles do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from relax.data.batch import TrainBatch

# A policy loss takes the algorithm's inputs for one micro-batch and returns (scalar loss, metrics).
LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


class TrainingBackend(Protocol):
    def compute_log_probs(self, batch: TrainBatch, *, reference: bool = False) -> list[torch.Tensor]:
        """Per-sample log-probs of the response tokens, [N][R_i], without gradient."""
        ...

    def train_batch(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One or more optimizer steps on `batch` with `loss_fn`; returns the step's metrics."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights in the engine's naming, for weight publishing."""
        ...

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...
