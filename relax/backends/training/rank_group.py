"""A group of FSDP training ranks, one Ray actor each, placed together with a placement group.

`TrainerGroup` has the methods of `TorchTrainer` (`compute_log_probs`, `train_batch`, `named_weights`,
`save`, `load`, `step`), so the roles use either. It splits a `TrainBatch` across ranks by tokens
(longest sample first onto the least-loaded rank), calls every rank at once (each call is a collective
among the ranks) and puts the answers back in the batch's order. Publishing runs on the ranks: all
gather full tensors bucket by bucket and rank 0 broadcasts them to the engines.

Rendezvous: rank 0's actor reports its node IP and a free port; every rank then joins
`tcp://ip:port` (gloo on CPU, NCCL on GPU). The same code runs 1 rank on a laptop and N ranks across the
nodes of a Ray cluster (checkpoints then need a folder every node sees).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from relax.backends.training.base import LossFn, check_train_batch
from relax.backends.training.critic_backend import with_old_values
from relax.backends.training.fsdp import NOSET_CUDA_ENV, FSDPWorker
from relax.backends.training.update import gather_rows, merge_partials, mini_batch_indices
from relax.config import TrainerConfig
from relax.data.batch import Ragged, TrainBatch
from relax.utils.cpu_affinity import with_cpu_affinity
from relax.utils.gc_freeze import with_frozen_startup
from relax.utils.placement import bundle_options, wait_for_placement

logger = logging.getLogger(__name__)


def balance_by_tokens(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Indices per rank, each list in the batch's order; greedy longest-first onto the lightest rank."""
    load = [0] * num_ranks
    shards: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(num_ranks), key=lambda r: (load[r], len(shards[r])))
        shards[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shards]


class TrainerGroup:
    def __init__(
        self,
        model_path: str,
        cfg: TrainerConfig,
        *,
        gpus_per_rank: float | None = None,
        gpu_group: str | None = None,
        cpus: str | None = None,
        placement: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """`options`: each rank's `FSDPWorker` options (dtype, total_steps, with_reference,
        reference_path, seed, with_critic). Where the ranks run: `gpus_per_rank` (None = one GPU on a GPU
        cluster, else 0), `gpu_group` (colocate: the named placement group shared with the engines),
        `cpus` (the training CPU budget the ranks are pinned to), `placement` (Ray `resources` added to
        each rank's bundle and a `label_selector` of the nodes the bundles may go to, from
        `resources.placement.ranks`; a colocate GPU group already places them)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n = cfg.num_ranks
        gpus = gpus_per_rank if gpus_per_rank is not None else (1 if _wants_gpu(cfg, n) else 0)
        if not gpus and cfg.device == "auto":
            # Ray leaves every GPU visible to an actor that asked for none: `auto` would put all ranks
            # on GPU 0, where NCCL refuses two ranks of one group. Ranks given no GPU train on the CPU.
            cfg = cfg.model_copy(update={"device": "cpu"})
        self.cfg = cfg
        if gpu_group and gpus:  # colocate: rank r shares bundle r (one GPU) with engine r
            self.pg = None
            placement = [bundle_options(gpu_group, r) for r in range(n)]
        else:
            placement_opts = placement or {}
            bundle = {
                "CPU": cfg.cpus_per_rank,
                **({"GPU": gpus} if gpus else {}),
                **placement_opts.get("resources", {}),
            }
            labels = placement_opts.get("label_selector")
            self.pg = placement_group(
                [bundle] * n, strategy="PACK", bundle_label_selector=[labels] * n if labels else None
            )
            wait_for_placement(self.pg, f"{n} training rank(s) of {bundle}")
            placement = [
                {
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=r
                    )
                }
                for r in range(n)
            ]
        # each rank is its own process, pinned to the training CPU budget when there is one
        rank_cls = ray.remote(
            with_frozen_startup(with_cpu_affinity(FSDPWorker, cpus, "resources.training_cpus"))
        )
        if gpus and n > 1 and cfg.ranks_see_all_gpus:
            # Ray would narrow CUDA_VISIBLE_DEVICES to the rank's own GPU; NCCL then cannot use
            # peer-to-peer copies between ranks and goes through host memory (FSDP's gathers and
            # reduce-scatters were slow: docs/trainer.md). The rank picks its GPU by index instead.
            for p in placement:
                p["runtime_env"] = {"env_vars": {NOSET_CUDA_ENV: "1"}}
        self.ranks = [
            rank_cls.options(num_cpus=cfg.cpus_per_rank, num_gpus=gpus, **placement[r]).remote(
                model_path, cfg, rank=r, world_size=n, **options
            )
            for r in range(n)
        ]
        addr, port = ray.get(self.ranks[0].address.remote())
        self._call_all("setup", addr, port)
        self.step = 0  # the weight version of the current parameters (all ranks agree)
        # PPO's critic, on the same ranks (FSDPWorker `with_critic`); the Actor uses it like a TorchCritic
        self.critic = GroupCritic(self) if options.get("with_critic") else None
        logger.info("trainer group: %d FSDP ranks, rendezvous at %s:%d", n, addr, port)

    # -- plumbing ----------------------------------------------------------------------------
    def _call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        return ray.get([getattr(r, method).remote(*args, **kwargs) for r in self.ranks])

    def _call_sharded(self, method: str, shards: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        calls = [
            getattr(r, method).remote(s, *args, **kwargs) for r, s in zip(self.ranks, shards, strict=True)
        ]
        return ray.get(calls)

    def _per_sample(self, method: str, batch: TrainBatch, **kwargs: Any) -> list[torch.Tensor]:
        shards = balance_by_tokens(batch.seq_lens(), len(self.ranks))
        results = self._call_sharded(method, [batch.subset(s) for s in shards], **kwargs)
        out: list[torch.Tensor] = [torch.empty(0)] * len(batch)
        for idx, rows in zip(shards, results, strict=True):
            for i, row in zip(idx, rows, strict=True):
                out[i] = row
        return Ragged(out)

    # -- the TrainingBackend seam ------------------------------------------------------------
    def compute_log_probs(self, batch: TrainBatch, *, reference: bool = False) -> list[torch.Tensor]:
        return self._per_sample("compute_log_probs", batch, reference=reference)

    def compute_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        return self._per_sample("compute_values", batch)

    def train_batch(
        self, batch: TrainBatch, loss_fn: LossFn, *, pi_old_from_forward: bool = False
    ) -> dict[str, float]:
        """`num_mini_batches` optimizer steps (the same mini-batches as `TorchTrainer`), each split by
        tokens (`pi_old_from_forward`: `TrainingBackend.train_batch`)."""
        check_train_batch(batch, pi_old_from_forward)
        minis, rows = self._shard_minis(batch)
        partials = self._call_sharded("train_minibatches", minis, loss_fn, pi_old_from_forward)
        if pi_old_from_forward:  # one mini-batch: each rank's first partial holds its rows' pi_old
            shards = [(r[0], p[0]["old_log_probs"]) for r, p in zip(rows, partials, strict=True)]
            batch.old_log_probs = gather_rows(len(batch), shards)
        self.step += 1
        return merge_partials(partials, "train")

    def _shard_minis(self, batch: TrainBatch) -> tuple[list[list[TrainBatch]], list[list[list[int]]]]:
        """Per rank, its share of every mini-batch (balanced by tokens), and the batch rows of each share."""
        per_rank: list[list[TrainBatch]] = [[] for _ in self.ranks]
        rows: list[list[list[int]]] = [[] for _ in self.ranks]
        seq_lens = batch.seq_lens()
        for mini in mini_batch_indices(len(batch), self.cfg.num_mini_batches):
            for r, shard in enumerate(balance_by_tokens([seq_lens[i] for i in mini], len(self.ranks))):
                rows[r].append([mini[j] for j in shard])
                per_rank[r].append(batch.subset(rows[r][-1]))
        return per_rank, rows

    def named_weights(self, mode: str = "full") -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under engine names, gathered on rank 0 and returned here (tests, disk sync)."""
        yield from self._call_all("named_weights", mode)[0].items()

    def gather_optimizer_state(self, key: str = "exp_avg") -> dict[str, torch.Tensor]:
        return self._call_all("gather_optimizer_state", key)[0]

    # -- publishing --------------------------------------------------------------------------
    def connect_engines(self, urls: list[str], bind: str = "auto") -> None:
        """Every rank learns every rank's GPU, so each receiver is served by exactly one rank. `bind`:
        `resources.bind`, resolved on rank 0's node for the group's rendezvous."""
        from relax.utils.auth import process_token

        # the run's token travels as an argument: the ranks' HTTP clients send it to the receivers
        uuids = self._call_all("device_uuid")
        self._call_all("connect_engines", urls, uuids, api_key=process_token(), bind=bind)

    def send_from_ranks(self, version: int, mode: str = "full", dtype: str | None = None) -> dict[str, float]:
        """All ranks gather, rank 0 broadcasts to the connected engines; returns bytes and seconds."""
        return self._call_all("gather_and_send", version, mode, dtype)[0]

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, path: Path | str) -> None:
        self._call_all("save", str(path))

    def load(self, path: Path | str) -> None:
        self.step = self._call_all("load", str(path))[0]

    def kill(self) -> None:
        """End the rank actors at once (no clean-up on the ranks), as a crash would."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for r in self.ranks:
            ray.kill(r)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.ranks = []

    def shutdown(self) -> None:
        """End the rank actors cleanly and free their placement group."""
        try:
            self._call_all("shutdown")
        except Exception:  # noqa: BLE001 - a rank may already be dead; kill them anyway
            logger.exception("trainer group: clean shutdown failed")
        self.kill()


class GroupCritic:
    """The critic held by a `TrainerGroup`'s ranks, with `TorchCritic`'s methods (the Actor uses either)."""

    def __init__(self, group: TrainerGroup) -> None:
        self.group = group

    def compute_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        return self.group._per_sample("compute_values", batch)

    def train_values(
        self, batch: TrainBatch, old_values: list[torch.Tensor], loss_fn: LossFn
    ) -> dict[str, float]:
        """`num_mini_batches` optimizer steps of the critic; metrics under `critic/`."""
        if batch.returns is None:
            raise ValueError("critic training needs batch.returns (from compute_advantages)")
        minis, _ = self.group._shard_minis(with_old_values(batch, old_values))
        return merge_partials(self.group._call_sharded("train_critic", minis, loss_fn), "critic")

    def save(self, path: Path | str) -> None:
        """Nothing to do: the ranks save the critic with the policy, into its `critic/` folder."""

    def load(self, path: Path | str) -> None:
        """Nothing to do: the ranks restore the critic with the policy."""


def _wants_gpu(cfg: TrainerConfig, ranks: int) -> bool:
    """Whether each of `ranks` ranks asks Ray for a GPU: `device: cuda` always; `auto` when the cluster
    has a GPU for every rank. With fewer (2 ranks on a 1-GPU host) `auto` trains on the CPU over gloo
    rather than wait for a placement that can never happen (NCCL refuses two ranks on one GPU);
    `device: cuda` keeps asking, for a cluster that may still grow, and the placement wait says why."""
    if cfg.device != "auto":
        return cfg.device == "cuda"
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    if 0 < gpus < ranks:
        logger.warning(
            "trainer.device=auto: %d rank(s) but %g GPU(s) in the cluster, so the ranks train on the CPU; "
            "set trainer.device=cuda to wait for GPUs, or trainer.num_ranks <= the GPUs",
            ranks,
            gpus,
        )
    return gpus >= ranks
