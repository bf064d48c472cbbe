"""The Advantages role (fully_async): waits until a step's rows carry old and (when the algorithm needs
them) reference log-probs, computes the step's advantages with the configured algorithm and writes
`advantages` (and `returns`) back, with the step's `advantages/*` metrics (`ADVANTAGES_METRICS`, which
the Actor reports with its own). `batch_advantages` is the same computation the Actor runs in process
in colocate and hybrid mode.

A plain class: Ray Serve deploys it (`relax.orchestration.service.deploy_role`), tests call it directly.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch

from relax.algorithms.pipeline import compute_advantages
from relax.config import RelaxConfig
from relax.data.batch import TrainBatch, pad_ragged
from relax.data.columns import (
    ADVANTAGES,
    ADVANTAGES_METRICS,
    LOG_PROBS,
    REF_LOG_PROBS,
    RETURNS,
    partition_name,
)
from relax.data.rows import tensor_column
from relax.dataplane.plane import STAGE_POLL_S, DataPlane
from relax.roles.stage import StageRole

logger = logging.getLogger(__name__)


def batch_advantages(
    cfg: RelaxConfig, batch: TrainBatch, values: list[torch.Tensor] | None
) -> dict[str, float]:
    """Fill `batch.advantages` (and `batch.returns`) for a whole step; returns `advantages/*` metrics."""
    lens = [len(m) for m in batch.loss_mask]  # = response lengths; the token columns may be absent
    T = max(1, max(lens))
    out = compute_advantages(
        cfg.algorithm,
        torch.tensor(batch.rewards, dtype=torch.float32),
        torch.tensor(batch.group_index, dtype=torch.long),
        pad_ragged(batch.loss_mask, T),
        log_probs_NT=pad_ragged(batch.old_log_probs, T) if batch.old_log_probs is not None else None,
        ref_log_probs_NT=pad_ragged(batch.ref_log_probs, T) if batch.ref_log_probs else None,
        values_NT=pad_ragged(values, T) if values is not None else None,
        response_lengths_N=torch.tensor(lens),
        max_response_len=cfg.rollout.max_new_tokens,
    )
    batch.advantages = [out.advantages_NT[i, : lens[i]] for i in range(len(lens))]
    if out.returns_NT is not None:
        batch.returns = [out.returns_NT[i, : lens[i]] for i in range(len(lens))]
    return {f"advantages/{k}": v for k, v in out.metrics.items()}


def pi_old_column(cfg: RelaxConfig) -> str:
    """The column that holds pi_old's log-probs: ActorFwd's recomputation, or the engine's behaviour
    log-probs under `algorithm.old_log_probs: rollout` (fully_async then deploys no ActorFwd)."""
    return "rollout_log_probs" if cfg.algorithm.pi_old_from_rollout else LOG_PROBS


def advantage_inputs(columns: dict[str, list], pi_old: str) -> TrainBatch:
    """The batch `batch_advantages` reads, from only the columns it needs: masks, rewards, groups, pi_old
    (and reference) log-probs. The token columns stay empty; fetching and decoding them was most of this
    role's data-plane time."""
    masks = [[float(m) for m in mask] for mask in columns["loss_mask"]]
    n = len(masks)
    return TrainBatch(
        prompt_ids=[[] for _ in range(n)],
        response_ids=[[] for _ in range(n)],
        loss_mask=masks,
        rollout_log_probs=[[] for _ in range(n)],
        rewards=[float(r) for r in columns["reward"]],
        group_index=[int(g) for g in columns["group_id"]],
        weight_versions=[0] * n,
        old_log_probs=[torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in columns[pi_old]],
        ref_log_probs=(
            [torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in columns[REF_LOG_PROBS]]
            if REF_LOG_PROBS in columns
            else None
        ),
    )


class AdvantagesRole(StageRole):
    def __init__(self, cfg: RelaxConfig, plane: DataPlane | None = None) -> None:
        from relax.utils.logging import setup_logging

        setup_logging()
        self.cfg = cfg
        self._use_plane(plane, cfg.schedule.data_plane)  # connects on first use
        self.pi_old = pi_old_column(cfg)
        self.inputs = ["loss_mask", "reward", "group_id", self.pi_old]
        if cfg.algorithm.needs_reference:
            self.inputs.append(REF_LOG_PROBS)
        self.task = f"advantages-{uuid.uuid4().hex[:8]}"  # a restarted replica is a new consumer
        self._task: asyncio.Task | None = None

    async def process(self, step: int, timeout_s: float | None = None) -> None:
        """Advantages of step `step`: blocks until every row has the input columns."""
        r = self.cfg.rollout
        partition = partition_name(step)
        data = await self.plane.get(
            partition,
            self.inputs,
            self.task,
            r.rows_per_step,
            timeout_s=timeout_s,
            poll_max_s=STAGE_POLL_S,
        )
        batch = advantage_inputs(data.columns, self.pi_old)
        metrics = await asyncio.to_thread(batch_advantages, self.cfg, batch, None)
        columns = {
            ADVANTAGES: tensor_column(batch.advantages),
            ADVANTAGES_METRICS: [metrics] + [{}] * (len(data.indexes) - 1),
        }
        if batch.returns is not None:
            columns[RETURNS] = tensor_column(batch.returns)
        await self.plane.put_columns(partition, data.indexes, columns)
