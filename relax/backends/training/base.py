"""The training-backend seam: what Actor, ActorFwd, Reference and Critic roles need from a trainer.

The in-process PyTorch backend implements it for one rank; a sharded backend (FSDP2 over several ranks,
or Megatron-LM) implements the same methods so the roles do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from relax.algorithms.pipeline import PolicyLossInputs
from relax.data.batch import TrainBatch

# A policy loss takes the algorithm's inputs for one micro-batch and returns (scalar loss, metrics).
LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


# Metric names of the on-policy ratio check (`RatioCheck`).
RATIO_DEV = "staleness/first_mb_ratio_dev"
BEHAVIOUR_RATIO_DEV = "staleness/first_mb_behaviour_ratio_dev"


class RatioCheck:
    """max |pi_theta / pi_old - 1| and max |pi_theta / mu - 1| over the loss tokens of the first
    mini-batch ("first_mb"), taken from the training forward itself: every micro-batch of the first
    optimizer step runs on the weights before the update, so the ratio is exactly 1 when the run is
    on-policy and pi_old came from these weights. It costs no extra forward pass (docs/trainer.md). Maxima
    stay on the device until `result`."""

    def __init__(self) -> None:
        self.dev_old: torch.Tensor | None = None
        self.dev_mu: torch.Tensor | None = None

    def add(self, x: PolicyLossInputs, behaviour_rows: list[bool]) -> None:
        """One micro-batch. `behaviour_rows[b]`: row b carries the engine's log-probs of every response
        token (rows without them, e.g. from a dataset, are left out of the behaviour ratio)."""
        with torch.no_grad():
            mask = x.loss_mask > 0
            logp = x.log_probs.detach()
            dev = torch.where(mask, (logp - x.old_log_probs).exp().sub(1).abs(), 0.0).amax()
            self.dev_old = dev if self.dev_old is None else torch.maximum(self.dev_old, dev)
            if x.rollout_log_probs is None:
                return
            rows = torch.tensor(behaviour_rows).to(mask.device, non_blocking=True)[:, None]
            dev = torch.where(mask & rows, (logp - x.rollout_log_probs).exp().sub(1).abs(), 0.0).amax()
            self.dev_mu = dev if self.dev_mu is None else torch.maximum(self.dev_mu, dev)

    def result(self) -> dict[str, float]:
        out = {}
        if self.dev_old is not None:
            out[RATIO_DEV] = float(self.dev_old)
        if self.dev_mu is not None:
            out[BEHAVIOUR_RATIO_DEV] = float(self.dev_mu)
        return out


def check_train_batch(batch: TrainBatch, pi_old_from_forward: bool) -> None:
    """The columns a policy update needs: advantages, and pi_old unless the update's forward gives it."""
    if batch.advantages is None or (batch.old_log_probs is None and not pi_old_from_forward):
        raise ValueError("train_batch needs batch.advantages and batch.old_log_probs filled in")


def has_behaviour(batch: TrainBatch, idx: list[int]) -> list[bool]:
    """Per row of `idx`: whether the engine's log-probs cover the whole response."""
    lp = batch.rollout_log_probs
    return [lp is not None and len(lp[i]) == len(batch.response_ids[i]) for i in idx]


class TrainingBackend(Protocol):
    def compute_log_probs(self, batch: TrainBatch, *, reference: bool = False) -> list[torch.Tensor]:
        """Per-sample log-probs of the response tokens, [N][R_i], without gradient."""
        ...

    def train_batch(
        self, batch: TrainBatch, loss_fn: LossFn, *, pi_old_from_forward: bool = False
    ) -> dict[str, float]:
        """One or more optimizer steps on `batch` with `loss_fn`; returns the step's metrics, with the
        `RatioCheck` of the first optimizer step for a policy loss. `pi_old_from_forward` (one optimizer
        step, on-policy): pi_old is the update's own forward (`update.Trainable.step`), written into
        `batch.old_log_probs` afterwards."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights in the engine's naming, for weight publishing."""
        ...

    def save(self, path: Path) -> None: ...

    def load(self, path: Path) -> None: ...
