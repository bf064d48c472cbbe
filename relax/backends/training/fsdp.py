"""One FSDP2 training rank: the policy (and, for PPO, the critic) sharded with `fully_shard`, the shared
forward and optimizer step (`update.Trainable`), DCP checkpoints, and full-weight gathering for publishing.

A plain class. `relax.backends.training.rank_group` runs one per Ray actor (gloo on CPU, NCCL on GPU); a
benchmark or a test may build one in process with `world_size=1`. Every public method that touches the
model is a collective: all ranks call it, in the same order, with their own shard of the data.

Exactness across rank counts and micro-batchings: the loss function scales each micro-batch by the
GLOBAL masked-token / sequence counts (all-reduced here), FSDP's reduce-scatter SUMS gradients (divide
factor 1), so the summed gradient equals that of one big batch on one rank. Ranks pad their list of
micro-batches with one-token dummies (zero loss) to the longest list, because every forward/backward
gathers parameters collectively.

PPO's critic is sharded like the policy, on the same ranks (`with_critic`): a critic on its own Ray
actors would need GPUs of its own, and in colocate mode each GPU's bundle is already split between the
engine and the rank. One process per GPU holding actor and critic is also verl's colocated layout.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from relax.backends.training import lora
from relax.backends.training.base import LossFn, RatioCheck
from relax.backends.training.forward import forward_rows
from relax.backends.training.loading import DTYPES, layer_types, load_model, resolve_device
from relax.backends.training.memory import MemoryPlan, check_static_fit, pending_update_bytes, plan_memory
from relax.backends.training.profiling import StepProbe
from relax.backends.training.update import (
    Totals,
    Trainable,
    check_pi_old_from_forward,
    full,
    read_trainer_state,
    write_trainer_state,
)
from relax.config import TrainerConfig
from relax.data.batch import TrainBatch, pack_micro_batches

logger = logging.getLogger(__name__)

# Ray leaves CUDA_VISIBLE_DEVICES alone in an actor started with this variable set to 1
NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
STATE_FILE = "trainer_state.json"
CRITIC_DIR = "critic"  # the critic's checkpoint folder inside the policy's


def compile_layers(layers: list[nn.Module], backend: str = "inductor") -> None:
    """`torch.compile` each decoder layer's forward, with dynamic shapes from the start.

    Micro-batches are ragged in rows and length. Left to its default, Dynamo specialised each dimension
    in turn and recompiled on every new combination (padded or not, one row or several), in later steps
    too (docs/gpus.md). Dynamic from the start it settles at three graphs: rows >= 2 with and without a
    padding mask, and one row."""
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)


class FSDPWorker:
    def __init__(
        self,
        model_path: str,
        cfg: TrainerConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        dtype: str = "float32",
        total_steps: int = 1,
        with_reference: bool = False,
        reference_path: str | None = None,
        seed: int = 0,
        with_critic: bool = False,
        reshard_after_forward: bool | None = None,
    ) -> None:
        """`with_critic`: also hold PPO's critic, sharded over the same ranks as the policy (the layout
        verl's users expect: one process per GPU holding actor and critic), trained with `train_critic`."""
        from relax.utils.logging import setup_logging

        setup_logging()  # a rank's own process: its INFO and warnings go to the run's log files
        self.model_path, self.cfg, self.rank, self.world_size = model_path, cfg, rank, world_size
        self.dtype, self.total_steps, self.with_reference = dtype, total_steps, with_reference
        self.reference_path = reference_path  # the reference/teacher folder; None = the policy's own
        self.seed, self.with_critic = seed, with_critic
        # False keeps each layer's gathered (bf16) weights from forward to backward: no second gather and
        # cast, at the memory of one unsharded model copy. None: False on one rank (the "gather" is a
        # local copy and cast, and the rank holds the whole model anyway), True on several.
        self.reshard_after_forward = (
            world_size > 1 if reshard_after_forward is None else reshard_after_forward
        )
        self.step = 0  # training steps taken (num_mini_batches optimizer steps each) == the weight version

    # -- set-up ------------------------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        """Rank 0: where the others rendezvous (this node's IP and a free port)."""
        from relax.utils.net import free_port, node_ip

        return node_ip(), free_port()

    def setup(self, master_addr: str, master_port: int) -> None:
        cfg = self.cfg
        torch.manual_seed(self.seed)
        torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device, cfg.attention_kernel)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.device.index or assigned_gpu_index())
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            if self.device.type != "cuda":
                from relax.utils.net import pin_gloo_interface

                pin_gloo_interface(master_addr)
            dist.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo",
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(minutes=30),
            )
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        mixed = self.device.type == "cuda" and cfg.mixed_precision == "bf16"
        self.mp_dtype = torch.bfloat16 if mixed else None
        fused = self.device.type == "cuda"  # one kernel for all parameters instead of a foreach chain
        kw = {"total_steps": self.total_steps, "fused": fused}
        # one rank: FSDP's gradient reduction is a copy, so it runs once per step, not per micro-batch
        kw["reduce_once"] = self.world_size == 1
        self.policy = Trainable(self._build(trainable=True, lora=True), cfg, self.device, **kw)
        self.model, self.optimizer, self.scheduler = (
            self.policy.model,
            self.policy.optimizer,
            self.policy.scheduler,
        )
        self.ref_model = None
        # with LoRA and no other reference model, the reference is the adapter-free policy
        if self.with_reference and (cfg.lora is None or self.reference_path is not None):
            self.ref_model = self._build(trainable=False, path=self.reference_path)
        self.critic = None
        if self.with_critic:  # a full-weight critic (no LoRA), trained beside the policy
            critic_model = self._build(trainable=True, value_head=True)
            self.critic = Trainable(critic_model, cfg, self.device, value=True, **kw)
        if self.device.type == "cuda":  # the weights and optimizer states must fit at all, before step 1
            trainable = sum(pending_update_bytes(t.optimizer) for t in self._trainables()) // 3
            check_static_fit(trainable, torch.cuda.memory_allocated(self.device), self.device)
        self.probe = StepProbe(self.rank, self.device)
        logger.info("FSDP rank %d/%d ready on %s", self.rank, self.world_size, self.device)

    def _reshard(self) -> bool:
        """Whether layers give their gathered weights back after forward: always with activation
        checkpointing, whose recompute gathers them again anyway and which is on because memory is short."""
        return self.reshard_after_forward or bool(self.cfg.gradient_checkpointing)

    def _set_reshard(self, model: nn.Module) -> None:
        """Checkpointing turned on by the memory plan: reshard after forward from now on."""
        for m in model.modules():
            if hasattr(m, "set_reshard_after_forward") and m is not model:
                m.set_reshard_after_forward(True, recurse=False)

    def _trainables(self) -> list[Trainable]:
        return [self.policy] + ([self.critic] if self.critic is not None else [])

    def _memory_plan(self, reduce_once: bool) -> MemoryPlan:
        pending = sum(
            pending_update_bytes(t.optimizer, reduce_once and t.reduce_once) for t in self._trainables()
        )
        if not self._reshard() and self.mp_dtype is not None:  # the kept bf16 copy
            pending += sum(p.numel() * 2 for t in self._trainables() for p in t.model.parameters())
        compute = 2 if self.mp_dtype is not None else DTYPES[self.dtype].itemsize
        return plan_memory(self.cfg, self.device, self.model, pending, compute)

    def _budget(self) -> int:
        """The micro-batch token budget: planned for every model this rank trains at the first call on a
        GPU, from the memory free then (the colocated engine holds its cache by now; `memory.py`)."""
        if self.policy.tokens is None:
            plan = self._memory_plan(reduce_once=True)
            if any(t.reduce_once for t in self._trainables()):
                per_micro_batch = self._memory_plan(reduce_once=False)
                if (plan.tokens, plan.checkpointing) != (
                    per_micro_batch.tokens,
                    per_micro_batch.checkpointing,
                ):
                    # the unsharded gradients would take room from the micro-batches (or turn on
                    # checkpointing): a trade not measured yet, so the gradients reduce per micro-batch
                    for t in self._trainables():
                        t.reduce_once = False
                    plan = per_micro_batch
            for t in self._trainables():
                t.apply(plan)
                if plan.checkpointing and not self._reshard():
                    self._set_reshard(t.model)
        return int(self.policy.tokens)

    def _build(
        self, trainable: bool, path: str | None = None, value_head: bool = False, lora: bool = False
    ) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        master = torch.float32 if self.mp_dtype is not None else DTYPES[self.dtype]
        model = load_model(
            path or self.model_path, master, self.cfg, trainable=trainable, value_head=value_head, lora=lora
        )
        mp = MixedPrecisionPolicy(param_dtype=self.mp_dtype, reduce_dtype=torch.float32)
        # A layer's inputs are not cast: its hidden states arrive in the compute dtype anyway, and a cast
        # that FSDP applies in the forward but (torch 2.11) not in activation checkpointing's recompute
        # left the vision blocks' fp32 rotary tables bf16 in one pass and fp32 in the other, which the
        # recompute refuses. The blocks upcast those tables themselves.
        layer_mp = MixedPrecisionPolicy(
            param_dtype=self.mp_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        no_split = layer_types(model)
        layers = [m for m in model.modules() if type(m).__name__ in no_split]
        compile_on = self.cfg.compile_layers
        if compile_on is None:  # auto: on a GPU the fused elementwise work is most of the gain left
            compile_on = self.device.type == "cuda"
        if compile_on:  # compile forward only: FSDP's hooks stay outside the graph
            compile_layers(layers)
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=layer_mp, reshard_after_forward=self._reshard())
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        for m in [model, *layers]:
            m.set_gradient_divide_factor(1.0)  # the loss is already scaled by global counts: SUM grads
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # torch >= 2.8
                m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
        return model

    # -- micro-batch plans -------------------------------------------------------------------
    def _all_reduce(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _plan(self, lengths: list[int]) -> list[list[int] | None]:
        """This rank's micro-batches, padded with `None` (dummy) to the longest list of any rank."""
        local: list[list[int] | None] = list(pack_micro_batches(lengths, self._budget()))
        count = int(self._all_reduce([len(local)], dist.ReduceOp.MAX)[0])
        return local + [None] * (count - len(local))

    def _totals(self, mini: TrainBatch, max_len: int) -> Totals:
        """The mini-batch's counts over every rank's share (a collective)."""
        tokens, seqs = self._all_reduce([sum(sum(m) for m in mini.loss_mask), len(mini)])
        return Totals(max(tokens, 1.0), seqs, max_len)

    # -- forward-only ------------------------------------------------------------------------
    def compute_log_probs(self, batch: TrainBatch, *, reference: bool = False) -> list[Tensor]:
        """Per-sample log-probs of the response tokens, [N][R_i] (reference: the frozen model/teacher)."""
        if reference and not self.with_reference:
            raise RuntimeError("reference log-probs requested but the trainer was built without a reference")
        plan = self._plan(batch.seq_lens())
        with self.probe.forward(self.step + 1):
            if not reference:
                return self.policy.forward_rows(batch, plan)
            if self.ref_model is not None:
                return forward_rows(self.ref_model, batch, plan, self.device, "logp", self.cfg.pack_sequences)
            with self.model.disable_adapter():  # LoRA: the reference is the policy without its adapters
                return self.policy.forward_rows(batch, plan)

    def compute_entropy(self, batch: TrainBatch) -> list[Tensor]:
        plan = self._plan(batch.seq_lens())
        with self.probe.forward(self.step + 1):
            return self.policy.forward_rows(batch, plan, "entropy")

    def compute_values(self, batch: TrainBatch) -> list[Tensor]:
        """Critic values of the states that emit each response token, [N][R_i]."""
        plan = self._plan(batch.seq_lens())
        with self.probe.forward(self.step + 1):
            return self._critic().forward_rows(batch, plan)

    def _critic(self) -> Trainable:
        if self.critic is None:
            raise RuntimeError(
                "critic values or training requested, but the ranks were built without a critic"
            )
        return self.critic

    # -- training ----------------------------------------------------------------------------
    def train_minibatches(
        self, minis: list[TrainBatch], loss_fn: LossFn, pi_old_from_forward: bool = False
    ) -> list[dict[str, Any]]:
        """One optimizer step of the policy per mini-batch (this rank's shard of it); returns per-step
        partial metrics to be merged over ranks with `update.merge_partials` (`pi_old_from_forward`:
        `update.Trainable.step`; the first partial then holds them)."""
        check = RatioCheck()
        check_pi_old_from_forward(pi_old_from_forward, len(minis))
        with self.probe.update(self.step + 1):
            out = self._steps(self.policy, minis, loss_fn, check, pi_old_from_forward)
        out[0]["ratio_check"] = check.result()
        out[0]["rank_metrics"] = {
            **self.probe.metrics(),
            "perf/micro_batch_tokens": float(self._budget()),
            "perf/activation_checkpointing": float(bool(self.policy.checkpointing)),
        }
        self.step += 1
        return out

    def train_critic(self, minis: list[TrainBatch], loss_fn: LossFn) -> list[dict[str, Any]]:
        """`train_minibatches` for the critic: a value loss on `returns` and the old values in
        `extras["old_values"]`. Does not advance the weight version (the policy's)."""
        return self._steps(self._critic(), minis, loss_fn, None)

    def _steps(
        self,
        model: Trainable,
        minis: list[TrainBatch],
        loss_fn: LossFn,
        check: RatioCheck | None,
        pi_old_from_forward: bool = False,
    ) -> list[dict[str, Any]]:
        longest = max([max(m.response_lens(), default=1) for m in minis], default=1)
        max_len = int(self._all_reduce([longest], dist.ReduceOp.MAX)[0])
        out = []
        for k, mini in enumerate(minis):
            plan, totals = self._plan(mini.seq_lens()), self._totals(mini, max_len)
            out.append(
                model.step(mini, plan, loss_fn, totals, check if k == 0 else None, pi_old_from_forward)
            )
        return out

    # -- weights -----------------------------------------------------------------------------
    def weight_stream(
        self, mode: str = "full", dtype: torch.dtype | None = None, skip_tied: bool = False
    ) -> Iterator[tuple[str, Tensor]]:
        """Full tensors under engine names, gathered one at a time (collective on every rank).

        mode: `full` (every weight; LoRA merged), `merged` (only LoRA-adapted modules, merged),
        `adapter` (LoRA adapter tensors only). `skip_tied`: a weight tied to one already sent (the
        LM head of a tied-embedding model) is neither gathered nor sent (see `without_tied`).
        """
        model = self.model
        if self.cfg.lora is None or mode == "full":
            items = lora.full_weights(model, full) if self.cfg.lora else _plain_weights(model, skip_tied)
        elif mode == "merged":
            items = lora.merged_weights(model, full)
        elif mode == "adapter":
            items = lora.adapter_weights(model, full)
        else:
            raise ValueError(f"unknown weight mode {mode!r}; use full, merged or adapter")
        for name, t in items:
            t = t.detach()
            yield name, t.to(dtype) if dtype is not None and t.is_floating_point() else t

    def named_weights(self, mode: str = "full") -> dict[str, Tensor] | None:
        """Rank 0: {name: full cpu tensor}; other ranks take part in the gathers and return None."""
        out = {n: t.cpu() for n, t in self.weight_stream(mode)}
        return out if self.rank == 0 else None

    def device_uuid(self) -> str | None:
        """This rank's GPU (None on CPU): receivers on it get weights by CUDA IPC from this rank."""
        from relax.weights.ipc import device_uuid

        return device_uuid(self.device)

    def connect_engines(
        self,
        urls: list[str],
        rank_uuids: list[str | None] | None = None,
        api_key: str | None = None,
        bind: str = "auto",
    ) -> None:
        """Rank 0 forms the weight-sync group with the receivers on other GPUs; each rank serves the
        receivers on its own GPU by CUDA IPC. `rank_uuids`: every rank's GPU (default: this rank alone);
        `api_key`: the run's token, which the receivers ask for; `bind`: `resources.bind`, where rank 0's
        rendezvous listens."""
        if api_key:
            from relax.utils.auth import set_process_token

            set_process_token(api_key)
        rank_uuids = rank_uuids if rank_uuids is not None else [self.device_uuid()]
        if self.rank < len(rank_uuids):
            self._rank_sender(bind).connect(urls, rank_uuids, self.rank)

    def gather_and_send(self, version: int, mode: str = "full", dtype: str | None = None) -> dict[str, float]:
        """Gather full weights in buckets and send each to this rank's receivers (rank 0: the group's).
        Returns bytes and time."""
        stream = self.weight_stream(mode, DTYPES[dtype] if dtype else None, skip_tied=True)
        return self._rank_sender().send_stream(stream, version, log=self.rank == 0)

    def _rank_sender(self, bind: str = "auto") -> Any:
        """This rank's `RankSender`, built at the first connect from `trainer.weight_sync_*` and `bind`."""
        if getattr(self, "_sender", None) is None:
            from relax.weights.rank_sender import RankSender  # HTTP clients: only when sending
            from relax.weights.sender import SenderSettings

            self._sender = RankSender(SenderSettings.from_config(self.cfg, bind), self.device)
        return self._sender

    def gather_optimizer_state(self, key: str = "exp_avg") -> dict[str, Tensor] | None:
        """Rank 0: {param name: full optimizer state `key`} (e.g. `exp_avg`, a read-out of the gradient)."""
        out = {}
        for name, p in self.model.named_parameters():
            if p in self.optimizer.state:
                out[name] = full(self.optimizer.state[p][key]).cpu()
        return out if self.rank == 0 else None

    # -- checkpoints -------------------------------------------------------------------------
    def _state_options(self) -> StateDictOptions:
        lora_run = self.cfg.lora is not None  # LoRA: only adapters (+ their optimizer state) are saved
        return StateDictOptions(ignore_frozen_params=lora_run, strict=not lora_run)

    def save(self, path: str | Path) -> None:
        """Sharded model + optimizer with DCP (loadable on any rank count); rank 0 writes the step. The
        critic, if any, goes to `path/critic` in the same layout."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.policy.save(path, self._state_options())
        if self.critic is not None:
            self.critic.save(path / CRITIC_DIR)
        if self.rank == 0:
            write_trainer_state(path, self.step, self.scheduler, STATE_FILE, world_size=self.world_size)
            if self.critic is not None:
                write_trainer_state(path / CRITIC_DIR, self.step, self.critic.scheduler, STATE_FILE)
        dist.barrier()

    def load(self, path: str | Path) -> int:
        path = Path(path)
        self.policy.load(path, self._state_options())
        self.step = read_trainer_state(path, self.scheduler, STATE_FILE)
        if self.critic is not None:
            self.critic.load(path / CRITIC_DIR)
            read_trainer_state(path / CRITIC_DIR, self.critic.scheduler, STATE_FILE)
        logger.info("rank %d restored from %s at step %d", self.rank, path, self.step)
        return self.step

    def get_step(self) -> int:
        return self.step

    def shutdown(self) -> None:
        if getattr(self, "_sender", None) is not None:
            self._sender.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _plain_weights(model: nn.Module, skip_tied: bool = False) -> Iterator[tuple[str, Tensor]]:
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():  # the parameters: tied ones are one object
        if skip_tied and id(t) in seen:
            continue
        seen.add(id(t))
        yield name, full(t.detach())


def assigned_gpu_index() -> int:
    """This rank's GPU when Ray left every GPU of the node visible (`trainer.ranks_see_all_gpus`): the
    one Ray assigned, as an index among the visible devices. Otherwise (Ray narrowed
    CUDA_VISIBLE_DEVICES to it, or no Ray) device 0."""
    if os.environ.get(NOSET_CUDA_ENV) != "1":
        return 0
    import ray

    ids = [str(i) for i in ray.get_gpu_ids()] if ray.is_initialized() else []
    if not ids:
        return 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible.index(ids[0]) if ids[0] in visible else int(ids[0]) if not visible else 0
