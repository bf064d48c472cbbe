"""In-process PPO critic (one rank): a value head over the policy's architecture, trained on returns with
the algorithm's value loss. The same forward, micro-batching and optimizer step as the policy trainer
(`update.Trainable`), so its metrics are token-weighted averages over micro-batches like the policy's.

With the FSDP backend (`trainer.uses_group`) the critic is not this class: it lives on the policy's rank
actors, sharded like the policy (`rank_group.GroupCritic`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from relax.backends.training.base import LossFn
from relax.backends.training.loading import DTYPES, load_model, resolve_device
from relax.backends.training.update import OLD_VALUES_KEY, Trainable, read_trainer_state
from relax.config import TrainerConfig
from relax.data.batch import TrainBatch

logger = logging.getLogger(__name__)

STATE_FILE = "critic_state.json"


def with_old_values(batch: TrainBatch, old_values: list[torch.Tensor]) -> TrainBatch:
    """`batch` (not changed) with the critic's values at rollout time in the column the value loss reads."""
    return dataclasses.replace(batch, extras={**batch.extras, OLD_VALUES_KEY: old_values})


class TorchCritic:
    def __init__(
        self, model_path: str, cfg: TrainerConfig, *, dtype: str = "float32", total_steps: int = 1
    ) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device, cfg.attention_kernel)
        model = load_model(model_path, DTYPES[dtype], cfg, trainable=True, value_head=True)
        self.critic = Trainable(model.to(self.device), cfg, self.device, total_steps=total_steps, value=True)
        self.model, self.optimizer, self.scheduler = model, self.critic.optimizer, self.critic.scheduler

    def compute_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        """Values of the states that emit each response token, [N][R_i]."""
        return self.critic.forward_rows(batch, self.critic.plan(batch))

    def train_values(
        self, batch: TrainBatch, old_values: list[torch.Tensor], loss_fn: LossFn
    ) -> dict[str, float]:
        """`num_mini_batches` optimizer steps on `batch.returns`; metrics under `critic/`."""
        if batch.returns is None:
            raise ValueError("critic training needs batch.returns (from compute_advantages)")
        return self.critic.train_local(with_old_values(batch, old_values), loss_fn, "critic")

    def save(self, path: Path) -> None:
        self.critic.save(Path(path))
        (Path(path) / STATE_FILE).write_text(json.dumps({"scheduler": self.scheduler.state_dict()}))

    def load(self, path: Path) -> None:
        self.critic.load(Path(path))
        read_trainer_state(Path(path), self.scheduler, STATE_FILE)
