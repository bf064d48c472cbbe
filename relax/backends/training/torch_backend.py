"""In-process PyTorch training backend (one rank): log-probs, token-budget micro-batches, AdamW, checkpoints.

The loss is handed in (`loss_fn`); this module knows nothing of the algorithm. The forward and the
optimizer step are the ones every trainer shares (`forward.py`, `update.py`); gradient accumulation is
exact because the loss function scales each micro-batch's loss by the global batch's token/sequence counts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from relax.backends.training.base import LossFn, check_train_batch
from relax.backends.training.forward import forward_rows
from relax.backends.training.loading import DTYPES, load_model, resolve_device
from relax.backends.training.update import Trainable, read_trainer_state, write_trainer_state
from relax.config import TrainerConfig
from relax.data.batch import TrainBatch

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


class TorchTrainer:
    """A causal LM with an optimizer on one device; the Actor/ActorFwd/Reference roles wrap it."""

    def __init__(
        self,
        model_path: str,
        cfg: TrainerConfig,
        *,
        dtype: str = "float32",
        total_steps: int = 1,
        with_reference: bool = False,
        reference_path: str | None = None,
        seed: int = 0,
    ) -> None:
        """`reference_path`: the frozen reference (or distillation teacher) model folder; None = the
        policy's own initial weights (`model_path`)."""
        torch.manual_seed(seed)
        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.device = resolve_device(cfg.device, cfg.attention_kernel)
        model = load_model(model_path, DTYPES[dtype], cfg, trainable=True).to(self.device)
        self.policy = Trainable(model, cfg, self.device, total_steps=total_steps, fused=True)
        self.model, self.optimizer, self.scheduler = model, self.policy.optimizer, self.policy.scheduler
        self.ref_model = None
        if with_reference:
            self.ref_model = load_model(reference_path or model_path, DTYPES[dtype], cfg, trainable=False)
            self.ref_model.to(self.device)
        # Training steps taken (each is num_mini_batches optimizer steps): the weight version of the
        # current parameters, the step a checkpoint resumes at, and what staleness is counted in.
        self.step = 0

    def compute_log_probs(self, batch: TrainBatch, *, reference: bool = False) -> list[torch.Tensor]:
        if not reference:
            return self.policy.forward_rows(batch, self.policy.plan(batch))
        if self.ref_model is None:
            raise RuntimeError("reference log-probs requested but the trainer was built without a reference")
        plan = self.policy.plan(batch)
        return forward_rows(self.ref_model, batch, plan, self.device, "logp", self.cfg.pack_sequences)

    def train_batch(
        self, batch: TrainBatch, loss_fn: LossFn, *, pi_old_from_forward: bool = False
    ) -> dict[str, float]:
        check_train_batch(batch, pi_old_from_forward)
        metrics = self.policy.train_local(batch, loss_fn, "train", pi_old_from_forward)
        self.step += 1
        return metrics

    # -- weights and checkpoints ---------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def save(self, path: Path) -> None:
        self.policy.save(Path(path))
        write_trainer_state(Path(path), self.step, self.scheduler, STATE_FILE)

    def load(self, path: Path) -> None:
        self.policy.load(Path(path))
        self.step = read_trainer_state(Path(path), self.scheduler, STATE_FILE)
        logger.info("trainer restored from %s at step %d", path, self.step)
