"""One FSDP2 training rank: the model sharded with `fully_shard`, AdamW, log-probs/entropy/values,
`train_batch` with token-budget micro-batches, DCP checkpoints, and full-weight gathering for publishing.

A plain class. `relax.backends.training.rank_group` runs one per Ray actor (gloo on CPU, NCCL on GPU); a
benchmark or a test may build one in process with `world_size=1`. Every public method that touches the
model is a collective: all ranks call it, in the same order, with their own shard of the data.

Exactness across rank counts and micro-batchings: the loss function scales each micro-batch by the
GLOBAL masked-token / sequence counts (all-reduced here), FSDP's reduce-scatter SUMS gradients (divide
factor 1), so the summed gradient equals that of one big batch on one rank. Ranks pad their list of
micro-batches with one-token dummies (zero loss) to the longest list, because every forward/backward
gathers parameters collectively.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from relax.algorithms.pipeline import PolicyLossInputs, ValueLossInputs
from relax.backends.training import forward as fw
from relax.backends.training import lora
from relax.backends.training.base import LossFn, RatioCheck, has_behaviour
from relax.backends.training.torch_backend import (
    DTYPES,
    enable_activation_checkpointing,
    lr_lambda,
    resolve_device,
)
from relax.config.schema import TrainerConfig
from relax.data.batch import TrainBatch, pack_micro_batches, pad_ragged

logger = logging.getLogger(__name__)

# Ray leaves CUDA_VISIBLE_DEVICES alone in an actor started with this variable set to 1
NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"

OLD_VALUES_KEY = "old_values"  # TrainBatch.extras column of critic values at rollout time, [N][R_i]


def full(t: Tensor) -> Tensor:
    """The whole tensor of a (possibly sharded) parameter; a collective for a DTensor sharded over more
    than one rank. On a one-rank mesh the local shard is the whole tensor: taking it skips DTensor's
    redistribution, about 45 us of host time per tensor (13 of the 35 ms a 290-tensor publish spent
    gathering on a 2-core CPU)."""
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.size() == 1:
        local = t.to_local()
        if local.shape == t.shape:  # no padding, no uneven split
            return local
    return t.full_tensor()


def compile_layers(layers: list[nn.Module], backend: str = "inductor") -> None:
    """`torch.compile` each decoder layer's forward, with dynamic shapes from the start.

    Micro-batches are ragged in rows and length. Left to its default, Dynamo specialised each dimension
    in turn and recompiled on every new combination (padded or not, one row or several): 5-10 s of
    inductor each time, in later steps too (a 2.4 s step took 8.6 s on an H200). Dynamic from the start it
    settles at three graphs: rows >= 2 with and without a padding mask, and one row."""
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
        critic: bool = False,
        reshard_after_forward: bool = True,
    ) -> None:
        self.model_path, self.cfg, self.rank, self.world_size = model_path, cfg, rank, world_size
        self.dtype, self.total_steps, self.with_reference = dtype, total_steps, with_reference
        self.reference_path = reference_path  # the reference/teacher folder; None = the policy's own
        self.seed, self.critic = seed, critic
        # False keeps each layer's gathered (bf16) weights from forward to backward: no second gather,
        # at the memory of one unsharded model copy (what one rank holds anyway, in fp32)
        self.reshard_after_forward = reshard_after_forward
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
        self.device = resolve_device(cfg.device)
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
        self.model = self._build(trainable=True)
        self.ref_model = None
        # with LoRA and no other reference model, the reference is the adapter-free policy
        if self.with_reference and (cfg.lora is None or self.reference_path is not None):
            self.ref_model = self._build(trainable=False, path=self.reference_path)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=cfg.lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
            fused=self.device.type == "cuda",  # one kernel for all parameters instead of a foreach chain
        )
        steps = self.total_steps * cfg.num_mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, steps))
        logger.info("FSDP rank %d/%d ready on %s", self.rank, self.world_size, self.device)

    def _build(self, trainable: bool, path: str | None = None) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from relax.models.multimodal_model import load_causal_lm

        master = torch.float32 if self.mp_dtype is not None else DTYPES[self.dtype]
        model: nn.Module = load_causal_lm(path or self.model_path, dtype=master)
        no_split = set(getattr(model, "_no_split_modules", None) or [])
        if trainable:
            # `from_pretrained` returns the model in eval mode, and Hugging Face layers checkpoint only in
            # training mode: without this, `gradient_checkpointing` kept every activation.
            model.train()
            if self.cfg.gradient_checkpointing:
                enable_activation_checkpointing(model)
        if trainable and self.cfg.lora is not None:
            model = lora.wrap_lora(model, self.cfg.lora)
        if self.critic:
            from relax.algorithms.critic import ValueHeadModel

            model = ValueHeadModel(model).to(master)
        if not trainable:
            model.eval().requires_grad_(False)
        mp = MixedPrecisionPolicy(param_dtype=self.mp_dtype, reduce_dtype=torch.float32)
        layers = [m for m in model.modules() if type(m).__name__ in no_split]
        if self.cfg.compile_layers:  # compile forward only: FSDP's hooks stay outside the graph
            compile_layers(layers)
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp, reshard_after_forward=self.reshard_after_forward)
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
        local: list[list[int] | None] = list(pack_micro_batches(lengths, self.cfg.max_tokens_per_micro_batch))
        count = int(self._all_reduce([len(local)], dist.ReduceOp.MAX)[0])
        return local + [None] * (count - len(local))

    # -- forward-only ------------------------------------------------------------------------
    @torch.no_grad()
    def _forward_only(self, batch: TrainBatch, what: str, reference: bool = False) -> list[Tensor]:
        out: list[Tensor] = [torch.empty(0)] * len(batch)
        model = self.ref_model if (reference and self.ref_model is not None) else self.model
        if reference and not self.with_reference:
            raise RuntimeError("reference log-probs requested but the trainer was built without a reference")
        for idx in self._plan(batch.seq_lens()):
            mb = fw.build_micro_batch(batch if idx is not None else None, idx or [], self.device)
            if what == "values":
                result = fw.value_forward(model, mb)
            elif reference and self.cfg.lora is not None:
                with self.model.disable_adapter():
                    result = fw.policy_forward(model, mb, with_entropy=False, pack=self.cfg.pack_sequences)[0]
            else:
                logp, ent = fw.policy_forward(
                    model, mb, with_entropy=what == "entropy", pack=self.cfg.pack_sequences
                )
                result = ent if what == "entropy" else logp
            for i, row in fw.split_rows(result, mb).items():
                out[i] = row
        return out

    def compute_log_probs(self, batch: TrainBatch, *, reference: bool = False) -> list[Tensor]:
        """Per-sample log-probs of the response tokens, [N][R_i] (reference: the frozen model/teacher)."""
        return self._forward_only(batch, "logp", reference)

    def compute_entropy(self, batch: TrainBatch) -> list[Tensor]:
        return self._forward_only(batch, "entropy")

    def compute_values(self, batch: TrainBatch) -> list[Tensor]:
        """Critic values of the states that emit each response token, [N][R_i]."""
        return self._forward_only(batch, "values")

    # -- training ----------------------------------------------------------------------------
    def train_minibatches(self, minis: list[TrainBatch], loss_fn: LossFn) -> list[dict[str, Any]]:
        """One optimizer step per mini-batch (this rank's shard of it); returns per-step partial metrics
        to be merged over ranks with `merge_partials`."""
        longest = max([max(m.response_lens(), default=1) for m in minis], default=1)
        max_len = int(self._all_reduce([longest], dist.ReduceOp.MAX)[0])
        check = RatioCheck()
        with self._profiled(self.step + 1):
            out = [
                self._optimizer_step(mini, loss_fn, max_len, check if k == 0 else None)
                for k, mini in enumerate(minis)
            ]
        out[0]["ratio_check"] = check.result()
        self.step += 1
        return out

    @contextlib.contextmanager
    def _profiled(self, step: int) -> Iterator[None]:
        """`RELAX_PROFILE_STEPS=3,7` (and `RELAX_PROFILE_DIR`, default `profiles`): run those training
        steps under the torch profiler and write each rank's top operators to
        `<dir>/train_step<N>_rank<R>.txt`."""
        steps = {int(x) for x in os.environ.get("RELAX_PROFILE_STEPS", "").split(",") if x.strip()}
        if step not in steps:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            yield
        out = Path(os.environ.get("RELAX_PROFILE_DIR", "profiles"))
        out.mkdir(parents=True, exist_ok=True)
        sort = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70)
        if self.device.type == "cuda":
            st = torch.cuda.memory_stats(self.device)
            keys = ("num_alloc_retries", "num_ooms", "reserved_bytes.all.peak", "allocated_bytes.all.peak")
            table += "\n" + " ".join(f"{k}={st.get(k, 0)}" for k in keys) + "\n"
        (out / f"train_step{step}_rank{self.rank}.txt").write_text(table)

    def _optimizer_step(
        self, mini: TrainBatch, loss_fn: LossFn, max_len: int, check: RatioCheck | None
    ) -> dict[str, Any]:
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        tokens, seqs = self._all_reduce([sum(sum(m) for m in mini.loss_mask), len(mini)])
        loss_total, weighted, weight_sum = 0.0, {}, 0.0
        for idx in self._plan(mini.seq_lens()):
            mb = fw.build_micro_batch(mini if idx is not None else None, idx or [], self.device)
            if idx is None:  # dummy: join the collectives, add nothing to the gradient
                out = (
                    fw.value_forward(self.model, mb)
                    if self.critic
                    else fw.policy_forward(self.model, mb, False, self.cfg.pack_sequences)[0]
                )
                (out.sum() * 0.0).backward()
                continue
            inputs = self._loss_inputs(mini, mb, max(tokens, 1.0), seqs, max_len)
            if check is not None and isinstance(inputs, PolicyLossInputs):
                check.add(inputs, has_behaviour(mini, idx))
            loss, metrics = loss_fn(inputs)
            loss.backward()
            loss_total += float(loss.detach())
            w = float(inputs.loss_mask.sum())
            weight_sum += w
            for k, v in metrics.items():
                weighted[k] = weighted.get(k, 0.0) + float(v) * w
        grad_norm = self._clip_grad_norm()
        lr = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("non-finite grad norm %s at step %d: update skipped", grad_norm, self.step)
        self.scheduler.step()
        return {
            "loss": loss_total,
            "weighted": weighted,
            "weight": weight_sum,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "seconds": time.perf_counter() - t0,  # on this rank (float(grad_norm) waited for the GPU)
        }

    def _loss_inputs(
        self, mini: TrainBatch, mb: fw.MicroBatch, tokens: float, seqs: float, max_len: int
    ) -> PolicyLossInputs | ValueLossInputs:
        def col(rows: list | None) -> Tensor | None:
            return None if rows is None else pad_ragged([rows[i] for i in mb.index], mb.T).to(self.device)

        if self.critic:
            return ValueLossInputs(
                values=fw.value_forward(self.model, mb),
                old_values=col(mini.extras[OLD_VALUES_KEY]),
                returns=col(mini.returns),
                loss_mask=col(mini.loss_mask),
                global_num_tokens=tokens,
                global_num_seqs=seqs,
                max_response_len=max_len,
            )
        logp_BT, ent_BT = fw.policy_forward(self.model, mb, with_entropy=True, pack=self.cfg.pack_sequences)
        return PolicyLossInputs(
            log_probs=logp_BT,
            old_log_probs=col(mini.old_log_probs),
            advantages=col(mini.advantages),
            loss_mask=col(mini.loss_mask),
            rollout_log_probs=col(mini.rollout_log_probs),
            ref_log_probs=col(mini.ref_log_probs),
            entropy=ent_BT,
            global_num_tokens=tokens,
            global_num_seqs=seqs,
            max_response_len=max_len,
        )

    def _clip_grad_norm(self) -> Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, False, None)
        norm = full(norm)  # a DTensor of partial norms -> the global norm
        torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, norm)
        return norm

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

    def connect_engines(self, urls: list[str], rank_uuids: list[str | None] | None = None) -> None:
        """Rank 0 forms the weight-sync group with the receivers on other GPUs; each rank serves the
        receivers on its own GPU by CUDA IPC. `rank_uuids`: every rank's GPU (default: this rank alone)."""
        rank_uuids = rank_uuids if rank_uuids is not None else [self.device_uuid()]
        if self.rank < len(rank_uuids):
            self._publisher().connect(urls, rank_uuids, self.rank)

    def publish(self, version: int, mode: str = "full", dtype: str | None = None) -> dict[str, float]:
        """Gather full weights in buckets; rank 0 broadcasts each to the engines. Returns bytes and time."""
        stream = self.weight_stream(mode, DTYPES[dtype] if dtype else None, skip_tied=True)
        return self._publisher().publish(stream, version, sender=self.rank == 0)

    def _publisher(self) -> Any:
        if getattr(self, "_rank_publisher", None) is None:
            from relax.weights.rank_publisher import RankPublisher  # HTTP clients: only when publishing

            c = self.cfg
            self._rank_publisher = RankPublisher(
                c.publish_bucket_mb << 20,
                c.weight_sync_backend,
                flatten=c.weight_sync_flatten is not False,
                ipc=c.weight_sync_ipc,
                device=self.device,
            )
        return self._rank_publisher

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
        """Sharded model + optimizer with DCP (loadable on any rank count); rank 0 writes the step."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        msd, osd = get_state_dict(self.model, self.optimizer, options=self._state_options())
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path / "dcp"))
        if self.rank == 0:
            torch.save(
                {"step": self.step, "scheduler": self.scheduler.state_dict()}, path / "trainer_state.pt"
            )
            (path / "trainer.json").write_text(json.dumps({"step": self.step, "world_size": self.world_size}))
        dist.barrier()

    def load(self, path: str | Path) -> int:
        path = Path(path)
        msd, osd = get_state_dict(self.model, self.optimizer, options=self._state_options())
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self._state_options(),
        )
        extra = torch.load(path / "trainer_state.pt", weights_only=False)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.step = int(extra["step"])
        logger.info("rank %d restored from %s at step %d", self.rank, path, self.step)
        return self.step

    def get_step(self) -> int:
        return self.step

    def shutdown(self) -> None:
        if getattr(self, "_rank_publisher", None) is not None:
            self._rank_publisher.close()
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


def merge_partials(per_rank: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Per-rank, per-step partial metrics -> one dict: losses summed over ranks (each rank's loss is its
    share of the global loss), metrics token-weighted, then averaged over the optimizer steps."""
    steps = len(per_rank[0])
    totals: dict[str, float] = {}
    for k in range(steps):
        parts = [r[k] for r in per_rank]
        weight = sum(p["weight"] for p in parts)
        metrics: dict[str, float] = {}
        for p in parts:
            for name, v in p["weighted"].items():
                metrics[f"train/{name}"] = metrics.get(f"train/{name}", 0.0) + v / max(weight, 1.0)
        metrics["train/loss"] = sum(p["loss"] for p in parts)
        metrics["train/grad_norm"] = parts[0]["grad_norm"]
        metrics["train/lr"] = parts[0]["lr"]
        if all("seconds" in p for p in parts):  # the slowest rank's optimizer step, summed over steps
            metrics["perf/rank_update_s"] = max(p["seconds"] for p in parts) * steps
        for name, v in metrics.items():
            totals[name] = totals.get(name, 0.0) + v / steps
    for r in per_rank:  # the ratio check of the first step: the largest deviation of any rank
        for name, v in r[0].get("ratio_check", {}).items():
            totals[name] = max(totals.get(name, 0.0), v)
    return totals
