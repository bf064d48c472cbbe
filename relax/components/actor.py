"""The Actor role: the trainer of the policy. In colocate mode it also runs, in process, what the
ActorFwd (old log-probs), Reference (reference log-probs) and Advantages roles do in fully_async mode.

A plain class: Ray Serve deploys it (`relax.orchestration.service.deploy_role`), tests call it directly.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from relax.algorithms.pipeline import compute_advantages, make_policy_loss, make_value_loss
from relax.algorithms.registry import get_algorithm
from relax.backends.training.critic_backend import TorchCritic
from relax.backends.training.torch_backend import TorchTrainer
from relax.config import RelaxConfig
from relax.data.batch import TrainBatch, pad_ragged
from relax.data.sample import Sample
from relax.distributed.actor_group import TrainerGroup
from relax.distributed.weight_publisher import WeightPublisher
from relax.utils.timer import timer

logger = logging.getLogger(__name__)


class ActorRole:
    def __init__(self, cfg: RelaxConfig) -> None:
        from relax.utils.logging import setup_logging

        setup_logging()
        self.cfg = cfg
        algo = cfg.algorithm
        spec = get_algorithm(algo.name)
        self.needs_reference = spec.needs_reference or algo.kl_coef > 0 or algo.reward_kl_coef > 0
        self.trainer = build_trainer(cfg, with_reference=self.needs_reference)
        self.loss_fn = make_policy_loss(cfg.algorithm)
        # PPO's critic trains alongside the actor, in process in colocate mode.
        self.critic = None
        if spec.needs_critic:
            self.critic = TorchCritic(
                cfg.model.path, cfg.trainer, dtype=cfg.model.dtype, total_steps=cfg.trainer.num_steps
            )
            self.value_loss_fn = make_value_loss(cfg.algorithm)
        self.publisher = WeightPublisher()
        self.sync_stats: dict[str, float] = {}  # bytes and seconds of the last weight publish

    # -- training ----------------------------------------------------------------------------
    async def train(self, samples: list[Sample]) -> dict[str, float]:
        return await asyncio.to_thread(self.train_sync, samples)

    def train_sync(self, samples: list[Sample]) -> dict[str, float]:
        times: dict[str, float] = {}
        batch = TrainBatch.from_samples(samples)
        with timer("old_log_probs", times):
            batch.old_log_probs = self.trainer.compute_log_probs(batch)
        if self.needs_reference:
            with timer("ref_log_probs", times):
                batch.ref_log_probs = self.trainer.compute_log_probs(batch, reference=True)
        values = None
        if self.critic is not None:
            with timer("values", times):
                values = self.critic.compute_values(batch)
        with timer("advantages", times):
            adv_metrics = self._advantages(batch, values)
        with timer("update", times):
            metrics = self.trainer.train_batch(batch, self.loss_fn)
        if self.critic is not None:
            with timer("critic_update", times):
                metrics.update(self.critic.train_values(batch, values, self.value_loss_fn))
        metrics.update(adv_metrics)
        metrics.update(_mismatch_metrics(batch))
        metrics.update({k.replace("perf/", "perf/actor_"): v for k, v in times.items()})
        metrics.update(self.sync_stats)  # the publish that gave the engines the weights of this rollout
        return metrics

    def _advantages(self, batch: TrainBatch, values: list[torch.Tensor] | None) -> dict[str, float]:
        lens = batch.response_lens()
        T = max(1, max(lens))
        mask_NT = pad_ragged(batch.loss_mask, T)
        out = compute_advantages(
            self.cfg.algorithm,
            torch.tensor(batch.rewards, dtype=torch.float32),
            torch.tensor(batch.group_index, dtype=torch.long),
            mask_NT,
            log_probs_NT=pad_ragged(batch.old_log_probs, T),
            ref_log_probs_NT=pad_ragged(batch.ref_log_probs, T) if batch.ref_log_probs else None,
            values_NT=pad_ragged(values, T) if values is not None else None,
            response_lengths_N=torch.tensor(lens),
            max_response_len=self.cfg.rollout.max_new_tokens,
        )
        batch.advantages = [out.advantages_NT[i, : lens[i]] for i in range(len(batch))]
        if out.returns_NT is not None:
            batch.returns = [out.returns_NT[i, : lens[i]] for i in range(len(batch))]
        return {f"advantages/{k}": v for k, v in out.metrics.items()}

    # -- weights -----------------------------------------------------------------------------
    async def connect_engines(self, urls: list[str]) -> None:
        if isinstance(self.trainer, TrainerGroup):  # rank 0 of the group joins the engines' group
            await asyncio.to_thread(self.trainer.connect_engines, urls)
        else:
            await self.publisher.connect(urls)

    async def push_weights(self) -> int:
        """Publish the current weights to every engine; returns the version they now report."""
        version = self.trainer.step
        if isinstance(self.trainer, TrainerGroup):
            mode = _sync_mode(self.cfg)
            self.sync_stats = await asyncio.to_thread(
                self.trainer.publish, version, mode, self.cfg.model.dtype
            )
            self.sync_stats.pop("tensors", None)
        else:
            named = list(self.trainer.named_weights())
            seconds = await self.publisher.publish(named, version)
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            self.sync_stats = {"perf/weight_sync_bytes": float(nbytes), "perf/weight_publish_s": seconds}
        logger.debug("weights v%d published: %s", version, self.sync_stats)
        return version

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self.trainer.save(Path(path))
        if self.critic is not None:
            (Path(path) / "critic").mkdir(exist_ok=True)
            self.critic.save(Path(path) / "critic")

    def load(self, path: str) -> int:
        self.trainer.load(Path(path))
        if self.critic is not None:
            self.critic.load(Path(path) / "critic")
        return self.trainer.step

    def weight_version(self) -> int:
        return self.trainer.step


def build_trainer(cfg: RelaxConfig, with_reference: bool) -> TorchTrainer | TrainerGroup:
    """The in-process trainer for the 1-rank default; the FSDP rank group for fsdp, N ranks or LoRA."""
    kwargs = {
        "dtype": cfg.model.dtype,
        "total_steps": cfg.trainer.num_steps,
        "with_reference": with_reference,
        "seed": cfg.run.seed,
    }
    if cfg.trainer.uses_group:
        return TrainerGroup(cfg.model.path, cfg.trainer, **kwargs)
    return TorchTrainer(cfg.model.path, cfg.trainer, **kwargs)


def _sync_mode(cfg: RelaxConfig) -> str:
    """What a publish sends: every weight; or for LoRA the adapters (engines that apply them) or the
    merged adapted modules (engines that load plain weights by name: the embedded engine, `auto`)."""
    lora = cfg.trainer.lora
    if lora is None:
        return "full"
    return "adapter" if lora.sync == "adapter" else "merged"


def _mismatch_metrics(batch: TrainBatch) -> dict[str, float]:
    """How far the engine's behaviour log-probs are from the trainer's (same weights in colocate mode)."""
    diffs = []
    for old, rollout, mask in zip(batch.old_log_probs, batch.rollout_log_probs, batch.loss_mask, strict=True):
        if len(rollout) == len(old) and len(old):
            m = torch.tensor(mask, dtype=torch.bool)
            diffs.append((old - torch.tensor(rollout))[m].abs())
    if not diffs:
        return {}
    d = torch.cat(diffs)
    return {
        "train/rollout_logp_abs_diff_mean": float(d.mean()),
        "train/rollout_logp_abs_diff_max": float(d.max()),
    }
