"""The Actor role: the trainer of the policy. It reads each step's rows from the data plane; in colocate
and hybrid mode it also runs, in process, what the ActorFwd (old log-probs), Reference (reference
log-probs) and Advantages roles do in fully_async mode.

A plain class: Ray Serve deploys it (`relax.orchestration.service.deploy_role`), tests call it directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from relax.algorithms.pipeline import make_policy_loss, make_value_loss
from relax.backends.training.critic_backend import TorchCritic
from relax.backends.training.rank_group import GroupCritic, TrainerGroup
from relax.backends.training.torch_backend import TorchTrainer
from relax.config import RelaxConfig
from relax.config.modes import actor_fetches_ahead, overlaps_push, stages_in_process, sub_batch_groups
from relax.data.batch import TrainBatch, flat_tensor
from relax.data.columns import (
    ADVANTAGES,
    ADVANTAGES_METRICS,
    LOG_PROBS,
    REF_LOG_PROBS,
    ROLLOUT_COLUMNS,
    partition_name,
)
from relax.data.rows import batch_from_columns
from relax.dataplane.plane import DataPlane, PlaneClient
from relax.dataplane.samplers import balance_partitions
from relax.roles.advantages import batch_advantages
from relax.rollout.staleness import staleness_metrics
from relax.utils.placement import ray_placement
from relax.utils.timer import timer
from relax.utils.write_errors import write_failure
from relax.weights.sender import SenderSettings, build_sender, send_weights
from relax.weights.sync_group import without_tied

logger = logging.getLogger(__name__)
ACTOR_POLL_S = 0.01  # the Actor's longest interval between data-plane polls while it waits for a step


class ActorRole(PlaneClient):
    def __init__(self, cfg: RelaxConfig, plane: DataPlane | None = None) -> None:
        from relax.utils.logging import setup_logging

        setup_logging()
        self.cfg = cfg
        spec = cfg.algorithm.spec
        # fully_async: ActorFwd, Reference and Advantages fill their columns; else they run in process.
        self.in_process = stages_in_process(cfg)
        self.needs_reference = cfg.algorithm.needs_reference and self.in_process
        self.trainer = build_trainer(cfg, with_reference=self.needs_reference, with_critic=spec.needs_critic)
        self.num_ranks = cfg.trainer.num_ranks
        self._use_plane(plane, cfg.schedule.data_plane)  # connects on first use
        # fully_async: under `old_log_probs: rollout` there is no ActorFwd and pi_old is filled from the
        # rollout log-probs in `train_sync`
        pi_old = [] if cfg.algorithm.pi_old_from_rollout else [LOG_PROBS]
        self.train_columns = ROLLOUT_COLUMNS + pi_old + [ADVANTAGES, ADVANTAGES_METRICS]
        if cfg.algorithm.needs_reference:
            self.train_columns.append(REF_LOG_PROBS)
        self.loss_fn = make_policy_loss(cfg.algorithm, tensor_metrics=True)
        # pi_old from the update's own forward instead of a forward pass of its own (same weights)
        self.pi_old_from_update = pi_old_from_update(cfg)
        # PPO's critic trains alongside the actor: in process beside the one-rank trainer, or on the FSDP
        # ranks, sharded like the policy
        self.critic: TorchCritic | GroupCritic | None = None
        if spec.needs_critic:
            self.critic = build_critic(cfg, self.trainer)
            self.value_loss_fn = make_value_loss(cfg.algorithm, tensor_metrics=True)
        # the one description of the run's weight transport; a rank group builds its senders from it too
        self.sender_settings = SenderSettings.from_config(
            cfg.trainer, cfg.resources.bind, disk_root=str(cfg.run.run_dir / "weights")
        )
        # a CPU trainer on a GPU host sends by gloo
        self.sender = build_sender(self.sender_settings, getattr(self.trainer, "device", None))
        # the rank group sends from its ranks, except through files, which the Actor writes
        self.ranks_send = isinstance(self.trainer, TrainerGroup) and cfg.trainer.weight_sync_backend != "disk"
        self.sync_stats: dict[str, float] = {}  # bytes and seconds of the last weight publish
        self._received_step = 0  # last step whose rows the Actor holds in full (for restarts)
        # Streaming modes fetch step k+1's rows ahead (relax/config/modes.py). When the update runs in
        # rank processes the fetch starts with it. With the in-process trainer it starts when the update
        # ends and overlaps the weight push instead: during the update it would share the interpreter
        # lock and slow the update (docs/modes.md).
        self.prefetch = actor_fetches_ahead(cfg)
        self.fetch_with_update = isinstance(self.trainer, TrainerGroup)
        # overlap_push: the weights each update ended with, by version, until the push of the next
        self.overlap_push = overlaps_push(cfg)
        self._kept: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._clearing: asyncio.Task | None = None  # the last trained step's partition, cleared meanwhile
        self._next: tuple[int, asyncio.Task] | None = None  # (step, fetch of its columns)

    # -- training ----------------------------------------------------------------------------
    async def train(self, step: int) -> dict[str, float]:
        """Train on step `step`'s partition, then clear it. fully_async: wait until every row has its
        advantages (and the columns they came from); otherwise stream the rows in sub-batches of whole
        groups, computing old/ref log-probs on each as it arrives, then advantages in process."""
        partition = partition_name(step)
        times: dict[str, float] = {}
        with timer("wait_data", times):
            columns = await self._take(step, times)
        last = step >= self.cfg.trainer.num_steps
        if self.prefetch and self.fetch_with_update and not last:
            self._next = (step + 1, asyncio.create_task(self._fetch(step + 1, ahead=True)))
        stage_metrics: dict[str, float] = {}  # fully_async: Advantages' metrics of the step
        for m in columns.pop(ADVANTAGES_METRICS, []):
            stage_metrics.update(m)
        with timer("decode", times):
            batch = batch_from_columns(columns)
        metrics = {**stage_metrics, **await asyncio.to_thread(self.train_sync, batch, times)}
        if self.overlap_push:
            await asyncio.to_thread(self._keep_weights)
        if self.prefetch and not self.fetch_with_update and not last:
            self._next = (step + 1, asyncio.create_task(self._fetch(step + 1)))
        await self._cleared()
        # Clearing takes a data-plane round trip: it runs while the driver pushes the weights, and the
        # next `train` makes sure it ended. The last step's is awaited here.
        self._clearing = asyncio.create_task(self.plane.clear(partition))
        if last:
            await self._cleared()
        return metrics

    async def _cleared(self) -> None:
        """Wait for the clearing of the previous step's partition (a failure is raised here)."""
        clearing, self._clearing = self._clearing, None
        if clearing is not None:
            await clearing

    async def _take(self, step: int, times: dict[str, float]) -> dict[str, list]:
        """Step `step`'s columns: from the fetch started while the step before trained, or fetched now."""
        ahead, self._next = self._next, None
        if ahead is not None and ahead[0] == step:
            columns, fetch_times = await ahead[1]
            times.update(fetch_times)
            return columns
        if ahead is not None:  # a fetch for another step (a resumed or repeated step): not ours
            ahead[1].cancel()
        columns, fetch_times = await self._fetch(step)
        times.update(fetch_times)
        return columns

    async def _fetch(self, step: int, ahead: bool = False) -> tuple[dict[str, list], dict[str, float]]:
        """Wait for step `step`'s rows and take them (marks them consumed by the Actor). The driver sends
        `train` without waiting for the Rollout, so a wait in `train` (or in a fetch that starts when the
        update before it ends) is on the step's critical path and polls a polling plane at least every
        `ACTOR_POLL_S`; a fetch `ahead` (started with the update before, in rank processes) keeps the
        plane's slower default, like the stage roles that wait ahead."""
        total, partition = self.cfg.rollout.rows_per_step, partition_name(step)
        times: dict[str, float] = {}
        poll = None if ahead else ACTOR_POLL_S
        if self.in_process:
            columns = await self._stream_forward(partition, total, times, poll)
        else:
            data = await self.plane.get(partition, self.train_columns, "actor", total, poll_max_s=poll)
            columns = data.columns
        self._received_step = max(self._received_step, step)
        return columns, times

    async def _stream_forward(
        self, partition: str, total: int, times: dict[str, float], poll_max_s: float | None = None
    ) -> dict[str, list]:
        r = self.cfg.rollout
        chunk = r.n_samples_per_prompt * sub_batch_groups(r.prompts_per_step)  # sub-batch of whole groups
        columns: dict[str, list] = {c: [] for c in ROLLOUT_COLUMNS}
        columns[LOG_PROBS], columns[REF_LOG_PROBS] = [], []
        while len(columns["reward"]) < total:
            data = await self.plane.get(
                partition,
                ROLLOUT_COLUMNS,
                "actor",
                min(chunk, total - len(columns["reward"])),
                sampler="whole_groups",
                poll_max_s=poll_max_s,
            )
            sub = batch_from_columns(data.columns)
            if self.cfg.algorithm.pi_old_from_rollout:
                with timer("old_log_probs", times):
                    columns[LOG_PROBS] += behaviour_log_probs(sub)
            elif not self.pi_old_from_update:
                with timer("old_log_probs", times):
                    columns[LOG_PROBS] += await asyncio.to_thread(self.trainer.compute_log_probs, sub)
            if self.needs_reference:
                with timer("ref_log_probs", times):
                    columns[REF_LOG_PROBS] += await asyncio.to_thread(
                        self.trainer.compute_log_probs, sub, reference=True
                    )
            for c in ROLLOUT_COLUMNS:
                columns[c] += data.columns[c]
        if not self.needs_reference:
            del columns[REF_LOG_PROBS]
        if self.pi_old_from_update and not self.cfg.algorithm.pi_old_from_rollout:
            del columns[LOG_PROBS]  # the update fills it
        if self.cfg.schedule.balance_data:
            order = [i for part in balance_partitions(columns["length"], self.num_ranks) for i in part]
            columns = {c: [v[i] for i in order] for c, v in columns.items()}
        return columns

    def train_sync(self, batch: TrainBatch, times: dict[str, float] | None = None) -> dict[str, float]:
        times = times if times is not None else {}
        from_update = False  # pi_old taken from the update's own forward
        if batch.old_log_probs is None:  # a whole batch handed in (tests), or pi_old = behaviour policy
            if self.cfg.algorithm.pi_old_from_rollout:
                with timer("old_log_probs", times):
                    batch.old_log_probs = behaviour_log_probs(batch)
            elif self.pi_old_from_update:
                from_update = True
            else:
                with timer("old_log_probs", times):
                    batch.old_log_probs = self.trainer.compute_log_probs(batch)
        if self.needs_reference and batch.ref_log_probs is None:
            with timer("ref_log_probs", times):
                batch.ref_log_probs = self.trainer.compute_log_probs(batch, reference=True)
        values = None
        if self.critic is not None:
            with timer("values", times):
                values = self.critic.compute_values(batch)
        adv_metrics: dict[str, float] = {}
        if batch.advantages is None:
            with timer("advantages", times):
                adv_metrics = batch_advantages(self.cfg, batch, values)
        metrics = staleness_metrics(
            self.trainer.step, batch.extras.get("weight_versions", [[v] for v in batch.weight_versions])
        )
        if self.cfg.schedule.debug_train_delay_s:
            time.sleep(self.cfg.schedule.debug_train_delay_s)
        with timer("update", times):
            metrics.update(self.trainer.train_batch(batch, self.loss_fn, pi_old_from_forward=from_update))
        if self.critic is not None:
            with timer("critic_update", times):
                metrics.update(self.critic.train_values(batch, values, self.value_loss_fn))
        metrics.update(adv_metrics)
        metrics.update(_mismatch_metrics(batch))
        metrics.update({k.replace("perf/", "perf/actor_"): v for k, v in times.items()})
        metrics.update(self.sync_stats)  # the publish that gave the engines the weights of this rollout
        return metrics

    # -- weights -----------------------------------------------------------------------------
    async def connect_engines(self, urls: list[str]) -> None:
        if self.ranks_send:  # rank 0 of the group joins the engines' group
            await asyncio.to_thread(self.trainer.connect_engines, urls, self.sender_settings.bind)
        else:
            await self.sender.connect(urls)

    def _keep_weights(self) -> None:
        """overlap_push: copy the weights this update ended with; the driver pushes them while the next
        update changes the live ones. The two newest versions are kept (a push retried after a failure
        sends the same copy)."""
        named = [(n, t.detach().clone()) for n, t in without_tied(self.trainer.named_weights())]
        self._kept[self.trainer.step] = named
        for old in sorted(self._kept)[:-2]:
            del self._kept[old]

    async def push_weights(self, version: int | None = None) -> int:
        """Publish weights to every engine; returns the version they now report. `version`: the copy
        kept when that update ended (overlap_push: the next update may be running); without one, the
        current weights."""
        kept = self._kept.get(version) if version is not None else None
        version = version if kept is not None else self.trainer.step
        if self.ranks_send:
            mode = _sync_mode(self.cfg)
            self.sync_stats = await asyncio.to_thread(
                self.trainer.send_from_ranks, version, mode, self.cfg.model.dtype
            )
            self.sync_stats.pop("tensors", None)
        else:
            named = kept if kept is not None else without_tied(self.trainer.named_weights())
            self.sync_stats = await send_weights(self.sender, named, version)
        logger.debug("weights v%d sent: %s", version, self.sync_stats)
        return version

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: str) -> None:
        """Trainer (and critic) state under `path`; a failed write raises an error naming its cause and
        file (a full disk), which the checkpoint writer's own error may hide."""
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
            self.trainer.save(Path(path))
            if self.critic is not None:
                (Path(path) / "critic").mkdir(exist_ok=True)
                self.critic.save(Path(path) / "critic")
        except BaseException as e:  # DCP's CheckpointException is a BaseException: Serve loses it
            if not isinstance(e, Exception | CheckpointException):
                raise
            raise write_failure(Path(path), e) from e

    def load(self, path: str) -> int:
        try:
            self.trainer.load(Path(path))
            if self.critic is not None:
                self.critic.load(Path(path) / "critic")
        except CheckpointException as e:  # a BaseException, which Serve does not carry back
            raise RuntimeError(f"loading {path} failed: {str(e).strip().splitlines()[-1]}") from e
        return self.trainer.step

    def received_step(self) -> int:
        """The last step whose rows the Actor holds in full, fetched ahead included (a restarted stage
        role starts after it)."""
        return self._received_step

    def weight_version(self) -> int:
        return self.trainer.step

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current policy weights on CPU (for ActorFwd in fully_async mode)."""
        return {n: t.detach().cpu() for n, t in self.trainer.named_weights()}


def pi_old_from_update(cfg: RelaxConfig) -> bool:
    """Whether the Actor takes pi_old from the update's own forward (`trainer.pi_old_from_update`): only
    where a separate forward pass would compute the same values, i.e. the Actor recomputes pi_old in
    process (colocate, hybrid) right before one optimizer step on the whole batch, and nothing needs
    pi_old before the update (reward-side KL and distillation advantages do)."""
    algo, t = cfg.algorithm, cfg.trainer
    needed_before = algo.reward_kl_coef > 0 or (algo.distill_coef > 0 and algo.distill_mode == "advantage")
    return (
        t.pi_old_from_update
        and stages_in_process(cfg)
        and not algo.pi_old_from_rollout
        and t.num_mini_batches == 1
        and not needed_before
    )


def behaviour_log_probs(batch: TrainBatch) -> list[torch.Tensor]:
    """`algorithm.old_log_probs: rollout`: the engine's log-probs of the sampled tokens as pi_old."""
    return [torch.as_tensor(lp, dtype=torch.float32) for lp in batch.rollout_log_probs]


def build_trainer(
    cfg: RelaxConfig, with_reference: bool, with_critic: bool = False
) -> TorchTrainer | TrainerGroup:
    """The in-process trainer for the 1-rank default; the FSDP rank group for fsdp, N ranks or LoRA (its
    ranks then also hold the critic when `with_critic`)."""
    kwargs = {
        "dtype": cfg.model.dtype,
        "total_steps": cfg.trainer.num_steps,
        "with_reference": with_reference,
        "reference_path": cfg.model.reference_path,
        "seed": cfg.run.seed,
    }
    if cfg.trainer.uses_group:
        return TrainerGroup(
            cfg.model.path,
            cfg.trainer,
            gpus_per_rank=cfg.resources.trainer_gpus,
            gpu_group=cfg.resources.gpu_group,
            cpus=cfg.resources.training_cpus,
            with_critic=with_critic,
            placement=ray_placement(cfg, "ranks"),
            **kwargs,
        )
    return TorchTrainer(cfg.model.path, cfg.trainer, **kwargs)


def build_critic(cfg: RelaxConfig, trainer: TorchTrainer | TrainerGroup) -> TorchCritic | GroupCritic:
    """PPO's critic, laid out like the policy: on the group's ranks (built with the group), or in process."""
    if isinstance(trainer, TrainerGroup):
        if trainer.critic is None:
            raise RuntimeError("the trainer group was built without a critic; pass with_critic=True")
        return trainer.critic
    return TorchCritic(cfg.model.path, cfg.trainer, dtype=cfg.model.dtype, total_steps=cfg.trainer.num_steps)


def _sync_mode(cfg: RelaxConfig) -> str:
    """What a publish sends: every weight; or for LoRA the adapters (engines that apply them) or the
    merged adapted modules (engines that load plain weights by name: the embedded engine, `auto`)."""
    lora = cfg.trainer.lora
    if lora is None:
        return "full"
    return "adapter" if lora.sync == "adapter" else "merged"


def _mismatch_metrics(batch: TrainBatch) -> dict[str, float]:
    """How far the engine's behaviour log-probs are from the trainer's (same weights in colocate mode)."""
    rows = zip(batch.old_log_probs, batch.rollout_log_probs, batch.loss_mask, strict=True)
    kept = [(old, rollout, mask) for old, rollout, mask in rows if len(rollout) == len(old) and len(old)]
    if not kept:
        return {}
    # one tensor op over the batch: per-sample tensors cost more, on the update's path (docs/measurements.md)
    old = torch.cat([o.reshape(-1) for o, _, _ in kept]).float()
    rollout = flat_tensor([r for _, r, _ in kept], torch.float32)
    mask = flat_tensor([ms for _, _, ms in kept], torch.bool)
    d = (old - rollout)[mask].abs()
    if not d.numel():
        return {}
    return {
        "train/rollout_logp_abs_diff_mean": float(d.mean()),
        "train/rollout_logp_abs_diff_max": float(d.max()),
    }
