"""The ActorFwd role (fully_async): recomputes the old-policy log-probs of a step's rows with the weights
the Actor holds right before training on that step; the same class, frozen, is the Reference role.

It streams: rows are forwarded in sub-batches of whole prompt groups as the Rollout writes them, and the
`log_probs` (or `ref_log_probs`) column goes back to the data plane sub-batch by sub-batch. For step k
ActorFwd first waits for the weights of training step k - 1 (pushed by the Controller after each
update); the Reference never waits.

A plain class: Ray Serve deploys it (`relax.orchestration.service.deploy_role`), tests call it directly.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import torch

from relax.backends.training.forward import forward_rows
from relax.backends.training.loading import DTYPES, load_model, resolve_device
from relax.backends.training.memory import forward_tokens
from relax.config import RelaxConfig
from relax.config.modes import sub_batch_groups
from relax.data.batch import TrainBatch, pack_micro_batches
from relax.data.columns import LOG_PROBS, REF_LOG_PROBS, partition_name
from relax.data.rows import tensor_column
from relax.dataplane.plane import STAGE_POLL_S, DataPlane
from relax.engine_api.protocol import version_to_engine
from relax.roles.stage import StageRole
from relax.utils.net import bind_address
from relax.weights.receiver import ModelWeightReceiver, ReceiverServer

logger = logging.getLogger(__name__)


class ActorFwdRole(StageRole):
    def __init__(self, cfg: RelaxConfig, reference: bool = False, plane: DataPlane | None = None) -> None:
        from relax.utils.logging import setup_logging

        setup_logging()
        torch.set_num_threads(cfg.trainer.threads)
        self.cfg = cfg
        self.reference = reference
        task, self.column = ("reference", REF_LOG_PROBS) if reference else ("actor_fwd", LOG_PROBS)
        # each replica is its own data-plane consumer: a restarted one takes again the rows its
        # predecessor took but never finished (recomputed values are the same)
        self.task = f"{task}-{uuid.uuid4().hex[:8]}"
        self.device = resolve_device(cfg.trainer.device, cfg.trainer.attention_kernel)
        path = (cfg.model.reference_path or cfg.model.path) if reference else cfg.model.path
        self.model = load_model(path, DTYPES[cfg.model.dtype], cfg.trainer, trainable=False).to(self.device)
        self._use_plane(plane, cfg.schedule.data_plane)  # connects on first use
        self.trained_through = -1 if not reference else 1 << 30  # training steps in the weights
        self._weights_changed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        # every weight it gets goes through the receive core: a push's buckets and a restart's state
        self.receiver = ModelWeightReceiver(self.model)
        self._server: ReceiverServer | None = None  # serves `receiver`, started by weight_url()

    def weight_url(self) -> str:
        """Join the trainer's weight broadcasts: the URL of this role's weight receiver (the trainer adds
        it to the engines of its weight-sync group, so weights arrive by NCCL/gloo broadcast, no host
        copy through Ray). `mark_trained` then says which training step the received weights hold."""
        if self._server is None:
            self._server = ReceiverServer(self.receiver, host=bind_address(self.cfg.resources.bind))
            self._server.start()
        return self._server.url

    async def mark_trained(self, trained_through: int) -> None:
        """The weights broadcast last (through `weight_url`) are those after training step `trained_through`."""
        async with self._weights_changed:
            self.trained_through = trained_through
            self._weights_changed.notify_all()

    async def set_weights(self, state: dict[str, torch.Tensor], trained_through: int) -> None:
        """Load the Actor's weights after training step `trained_through` (a restarted replica that must
        forward the step in training before the next push reaches its receiver)."""
        self.receiver.load(state.items(), version_to_engine(trained_through))
        async with self._weights_changed:
            self.trained_through = trained_through
            self._weights_changed.notify_all()

    async def process(self, step: int, timeout_s: float | None = None) -> None:
        """Write this role's column for every row of step `step` (blocks on the weights, then on rows)."""
        if not self.reference:
            async with self._weights_changed:
                await self._weights_changed.wait_for(lambda: self.trained_through >= step - 1)
        r = self.cfg.rollout
        total = r.rows_per_step
        chunk = r.n_samples_per_prompt * sub_batch_groups(r.prompts_per_step)  # sub-batch of whole groups
        partition = partition_name(step)
        done = 0
        while done < total:
            data = await self.plane.get(
                partition,
                ["prompt_ids", "response_ids", "loss_mask", "rollout_log_probs"],
                self.task,
                min(chunk, total - done),
                timeout_s=timeout_s,
                poll_max_s=STAGE_POLL_S,
            )
            batch = TrainBatch(
                prompt_ids=data.columns["prompt_ids"],
                response_ids=data.columns["response_ids"],
                loss_mask=data.columns["loss_mask"],
                rollout_log_probs=data.columns["rollout_log_probs"],
                rewards=[0.0] * len(data),
                group_index=[0] * len(data),
                weight_versions=[0] * len(data),
            )
            t = self.cfg.trainer
            plan = pack_micro_batches(batch.seq_lens(), forward_tokens(t, self.device))
            logp = await asyncio.to_thread(
                forward_rows, self.model, batch, plan, self.device, "logp", t.pack_sequences
            )
            await self.plane.put_columns(partition, data.indexes, {self.column: tensor_column(logp)})
            done += len(data)

    async def stop(self) -> None:
        await super().stop()
        if self._server is not None:
            self._server.stop()
            self._server = None
        self.receiver.inbox.close()
