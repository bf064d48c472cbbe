"""One optimizer step, shared by every trainer: the one-rank policy trainer, the critic (in process or on
the FSDP ranks) and each FSDP rank. A `Trainable` is a model with its AdamW and learning-rate schedule;
`step` runs a mini-batch's micro-batches forward and backward and takes one optimizer step, and
`forward_rows` is its forward-only pass (`forward.forward_rows`, the one forward path).

Exact gradient accumulation: the loss function scales each micro-batch's loss by the GLOBAL counts of
the mini-batch (`Totals`: masked tokens and sequences over all micro-batches and ranks), so summing the
micro-batch gradients (and, under FSDP, the ranks' gradients) gives the gradient of one big batch.

A step returns a *partial*: its loss (this rank's share of the global loss), its loss metrics summed
with weight = masked tokens per micro-batch, that weight, the gradient norm, the learning rate and the
seconds it took. `merge_partials` turns the partials of every rank and optimizer step into the step's
metrics: losses summed over ranks, metrics token-weighted, then averaged over optimizer steps.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from relax.algorithms.pipeline import PolicyLossInputs, ValueLossInputs
from relax.backends.training import forward as fw
from relax.backends.training.base import LossFn, RatioCheck, has_behaviour
from relax.backends.training.loading import enable_activation_checkpointing
from relax.backends.training.memory import CPU_TOKENS, MemoryPlan, pending_update_bytes, plan_memory
from relax.config import TrainerConfig
from relax.data.batch import Ragged, TrainBatch, pack_micro_batches, pad_ragged

logger = logging.getLogger(__name__)

OLD_VALUES_KEY = "old_values"  # TrainBatch.extras column of critic values at rollout time, [N][R_i]


def lr_lambda(cfg: TrainerConfig, total_steps: int) -> Callable[[int], float]:
    """Warm-up then constant / cosine / linear decay to `min_lr_ratio`, as a LambdaLR multiplier."""

    def fn(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return fn


def full(t: Tensor) -> Tensor:
    """The whole tensor of a (possibly sharded) parameter; a collective for a DTensor sharded over more
    than one rank. On a one-rank mesh the local shard is the whole tensor: taking it skips DTensor's
    redistribution and its host time per tensor (docs/trainer.md)."""
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.size() == 1:
        local = t.to_local()
        if local.shape == t.shape:  # no padding, no uneven split
            return local
    return t.full_tensor()


def mini_batch_indices(n: int, num_mini_batches: int) -> list[list[int]]:
    """The rows of each optimizer step: mini-batch k takes rows k, k+M, k+2M, ... (every backend alike)."""
    return [list(range(n))[k::num_mini_batches] for k in range(num_mini_batches)]


@dataclass(frozen=True)
class Totals:
    """What the loss scales a micro-batch by: counts over the whole mini-batch, every rank's share."""

    tokens: float  # masked (trained) response tokens, at least 1
    seqs: float  # sequences
    max_len: int  # longest response of the whole training batch (seq_mean_token_sum_norm)


def local_totals(mini: TrainBatch, max_len: int) -> Totals:
    """`Totals` of a mini-batch held whole by one rank."""
    return Totals(max(float(sum(sum(m) for m in mini.loss_mask)), 1.0), float(len(mini)), max_len)


class StepSums:
    """An optimizer step's loss, loss-mask weight and weighted metrics, summed over its micro-batches
    where they were computed (device tensors or floats) and read with one device-to-host copy."""

    def __init__(self) -> None:
        self.loss: Tensor | float = 0.0
        self.weight: Tensor | float = 0.0
        self.weighted: dict[str, Tensor | float] = {}

    def add(self, loss: Tensor | float, weight: Tensor | float, metrics: dict[str, Any]) -> None:
        def f64(x: Tensor | float) -> Tensor | float:  # the host's float precision, on the device
            return x.detach().double() if isinstance(x, Tensor) else float(x)

        weight = f64(weight)
        self.loss = self.loss + f64(loss)
        self.weight = self.weight + weight
        for k, v in metrics.items():
            self.weighted[k] = self.weighted.get(k, 0.0) + f64(v) * weight

    def values(self) -> tuple[float, float, dict[str, float]]:
        """(loss, weight, {metric: weighted sum}) as floats."""
        flat = [self.loss, self.weight, *self.weighted.values()]
        on_device = [i for i, v in enumerate(flat) if isinstance(v, Tensor)]
        if on_device:
            read = torch.stack([flat[i].reshape(()) for i in on_device]).tolist()
            for i, v in zip(on_device, read, strict=True):
                flat[i] = v
        loss, weight, *rest = (float(v) for v in flat)
        return loss, weight, dict(zip(self.weighted, rest, strict=True))


class Trainable:
    """A model with its AdamW and learning-rate schedule. `value=True`: a critic (`ValueHeadModel`)
    trained with a value loss on `batch.returns` and the old values in `batch.extras["old_values"]`;
    otherwise a policy trained with a policy loss on `batch.advantages` and `batch.old_log_probs`."""

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainerConfig,
        device: torch.device,
        *,
        total_steps: int = 1,
        fused: bool = True,
        value: bool = False,
        reduce_once: bool = False,
    ) -> None:
        self.model, self.cfg, self.device, self.value = model, cfg, device, value
        # an FSDP model on one rank: its gradients accumulate unsharded (in the reduce dtype) over a
        # step's micro-batches and are reduced once, at the last; per micro-batch, the reduction (a
        # copy in, a one-rank reduce-scatter, an accumulation into the sharded gradient) only moves
        # bytes. Not on several ranks, where the unsharded gradients would cost a whole model's worth
        # of memory on each; and turned off by the rank's memory plan where their copy would shrink the
        # micro-batches (`FSDPWorker._budget`).
        self.reduce_once = reduce_once
        # the micro-batch token budget: the config's, or planned at first use (`memory.plan_memory`)
        self.tokens: int | None = (
            None if device.type == "cuda" else cfg.max_tokens_per_micro_batch or CPU_TOKENS
        )
        self.checkpointing = bool(cfg.gradient_checkpointing)
        params = [p for p in model.parameters() if p.requires_grad]
        # fused: one kernel (CUDA) or one pass (CPU) over all parameters instead of a chain of small ops
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused
        )
        steps = total_steps * cfg.num_mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, steps))

    # -- forward -----------------------------------------------------------------------------
    def plan(self, batch: TrainBatch) -> list[list[int] | None]:
        """This (one) rank's micro-batches of `batch` under the token budget."""
        return list(pack_micro_batches(batch.seq_lens(), self.budget()))

    def budget(self) -> int:
        """The micro-batch token budget, planned from the free memory at the first call on a GPU."""
        if self.tokens is None:
            pending = pending_update_bytes(self.optimizer, self.reduce_once)
            self.apply(plan_memory(self.cfg, self.device, self.model, pending))
        return int(self.tokens)

    def apply(self, plan: MemoryPlan) -> None:
        """Take a memory plan: its budget, and activation checkpointing if it asks for it."""
        if plan.checkpointing and not self.cfg.gradient_checkpointing:
            enable_activation_checkpointing(getattr(self.model, "backbone", self.model))
        self.tokens, self.checkpointing = plan.tokens, plan.checkpointing
        logger.info(
            "micro-batches of %d tokens, activation checkpointing %s (%s)",
            plan.tokens,
            "on" if plan.checkpointing else "off",
            plan.why,
        )

    def forward_rows(
        self, batch: TrainBatch, plan: list[list[int] | None], what: str | None = None
    ) -> list[Tensor]:
        """Forward-only outputs per sample (`forward.forward_rows`): values for a critic, else `what`."""
        what = "values" if self.value else (what or "logp")
        return fw.forward_rows(self.model, batch, plan, self.device, what, self.cfg.pack_sequences)

    def loss_inputs(
        self, mini: TrainBatch, mb: fw.MicroBatch, totals: Totals, pi_old_from_forward: bool = False
    ) -> PolicyLossInputs | ValueLossInputs:
        """The loss function's inputs for micro-batch `mb` of `mini`, with the forward (and its graph).
        `pi_old_from_forward`: pi_old is this forward's own log-probs, detached (see `step`)."""

        def col(rows: list | None) -> Tensor | None:  # queued behind the forward, not waiting for it
            if rows is None:
                return None
            return pad_ragged([rows[i] for i in mb.index], mb.T).to(self.device, non_blocking=True)

        if self.value:
            return ValueLossInputs(
                values=fw.value_forward(self.model, mb),
                old_values=col(mini.extras[OLD_VALUES_KEY]),
                returns=col(mini.returns),
                loss_mask=col(mini.loss_mask),
                global_num_tokens=totals.tokens,
                global_num_seqs=totals.seqs,
                max_response_len=totals.max_len,
            )
        logp_BT, ent_BT = fw.policy_forward(self.model, mb, with_entropy=True, pack=self.cfg.pack_sequences)
        return PolicyLossInputs(
            log_probs=logp_BT,
            old_log_probs=logp_BT.detach() if pi_old_from_forward else col(mini.old_log_probs),
            advantages=col(mini.advantages),
            loss_mask=col(mini.loss_mask),
            rollout_log_probs=col(mini.rollout_log_probs),
            ref_log_probs=col(mini.ref_log_probs),
            entropy=ent_BT,
            global_num_tokens=totals.tokens,
            global_num_seqs=totals.seqs,
            max_response_len=totals.max_len,
        )

    def _dummy(self, mb: fw.MicroBatch) -> Tensor:
        """A forward that joins the ranks' collectives and adds nothing to the gradient."""
        if self.value:
            return fw.value_forward(self.model, mb).sum() * 0.0
        return fw.policy_forward(self.model, mb, False, self.cfg.pack_sequences)[0].sum() * 0.0

    # -- the optimizer step --------------------------------------------------------------------
    def step(
        self,
        mini: TrainBatch,
        plan: list[list[int] | None],
        loss_fn: LossFn,
        totals: Totals,
        check: RatioCheck | None = None,
        pi_old_from_forward: bool = False,
    ) -> dict[str, Any]:
        """One optimizer step on `mini` (this rank's share), micro-batch by micro-batch as `plan` says;
        returns the partial (module docstring). `check`: the on-policy ratio check of this step.

        `pi_old_from_forward`: `mini.old_log_probs` is not filled; pi_old is the log-probs of this step's
        own forward, detached. Right only for the first optimizer step on weights that pi_old is meant to
        be (on-policy, pi_old recomputed by the trainer): every micro-batch's forward then runs on those
        weights, so a separate forward pass would compute the same values. The partial then also holds
        them per row of `mini` (`old_log_probs`), for the metrics that compare them with the engine's."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        # the step's sums stay on the device until its end: a float per micro-batch would make the host
        # wait for each micro-batch's kernels, and the GPU then for the host to build the next one
        sums = StepSums()
        old_rows = fw.RowsToHost()
        last = max((n for n, idx in enumerate(plan) if idx is not None), default=-1)
        for n, idx in enumerate(plan):
            mb = fw.micro_batch(self.model, mini, idx, self.device)
            if self.reduce_once:
                self.model.set_requires_gradient_sync(n >= last)
            if idx is None:
                self._dummy(mb).backward()
                continue
            inputs = self.loss_inputs(mini, mb, totals, pi_old_from_forward)
            if pi_old_from_forward:
                old_rows.add(inputs.old_log_probs, mb)
            if check is not None and isinstance(inputs, PolicyLossInputs):
                check.add(inputs, has_behaviour(mini, idx))
            loss, metrics = loss_fn(inputs)
            loss.backward()
            sums.add(loss.detach(), inputs.loss_mask.sum(), metrics)
        grad_norm = self.clip_grad_norm()
        lr = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("non-finite grad norm %s: update skipped", grad_norm)
        self.scheduler.step()
        loss_total, weight_sum, weighted = sums.values()
        partial = {
            "loss": loss_total,
            "weighted": weighted,
            "weight": weight_sum,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "seconds": time.perf_counter() - t0,  # float(grad_norm) waited for the device
        }
        if pi_old_from_forward:  # (rows of `mini`, their values): one flat tensor across processes
            rows = old_rows.rows()
            partial["old_log_probs"] = (list(rows), Ragged(rows.values()))
        return partial

    def clip_grad_norm(self) -> Tensor:
        """Clip by the global gradient norm; under FSDP the DTensor of partial norms is gathered first."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, False, None)
        norm = full(norm)
        torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, norm)
        return norm

    def train_local(
        self, batch: TrainBatch, loss_fn: LossFn, prefix: str, pi_old_from_forward: bool = False
    ) -> dict[str, float]:
        """`num_mini_batches` optimizer steps on a batch held whole by this one rank; the step's metrics
        under `prefix/` (with the on-policy ratio check of the first step for a policy).
        `pi_old_from_forward` (one mini-batch only; `step`): fills `batch.old_log_probs` from the update."""
        max_len = int(max(batch.response_lens(), default=0) or 1)
        check = None if self.value else RatioCheck()
        minis = mini_batch_indices(len(batch), self.cfg.num_mini_batches)
        check_pi_old_from_forward(pi_old_from_forward, len(minis))
        partials = []
        for k, idx in enumerate(minis):
            mini = batch.subset(idx)
            totals = local_totals(mini, max_len)
            check_k = check if k == 0 else None
            partials.append(self.step(mini, self.plan(mini), loss_fn, totals, check_k, pi_old_from_forward))
        if pi_old_from_forward:
            batch.old_log_probs = gather_rows(len(batch), [(minis[0], partials[0]["old_log_probs"])])
        return {**merge_partials([partials], prefix), **(check.result() if check else {})}

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, path: Path, options: StateDictOptions | None = None) -> None:
        """Model and optimizer state with DCP under `path/dcp` (a collective under FSDP; loadable on any
        rank count)."""
        msd, osd = get_state_dict(self.model, self.optimizer, options=options)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(path) / "dcp"))

    def load(self, path: Path, options: StateDictOptions | None = None) -> None:
        msd, osd = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )


def check_pi_old_from_forward(pi_old_from_forward: bool, num_mini_batches: int) -> None:
    """pi_old from the update's forward holds for one optimizer step only: after it the weights moved."""
    if pi_old_from_forward and num_mini_batches != 1:
        raise ValueError(
            f"pi_old from the update's own forward needs one optimizer step per batch, not {num_mini_batches} "
            "(trainer.num_mini_batches): later mini-batches run on updated weights"
        )


def gather_rows(n: int, parts: list[tuple[list[int], tuple[list[int], list[Tensor]]]]) -> Ragged:
    """Per-sample tensors of a batch of `n` rows from shards: (the shard's rows in the batch, (rows in
    the shard, their tensors))."""
    out: list[Tensor] = [torch.empty(0)] * n
    for rows, (local, values) in parts:
        for i, t in zip(local, values, strict=True):
            out[rows[i]] = t
    return Ragged(out)


def write_trainer_state(path: Path, step: int, scheduler: Any, state_file: str, **meta: Any) -> None:
    """The step and scheduler beside a DCP checkpoint, as JSON (`state_file`: a checkpoint's state is data
    that loading cannot turn into code), and `trainer.json` for people."""
    state = {"step": step, "scheduler": scheduler.state_dict()}
    (Path(path) / state_file).write_text(json.dumps(state))
    (Path(path) / "trainer.json").write_text(json.dumps({"step": step, **meta}))


def read_trainer_state(path: Path, scheduler: Any, state_file: str) -> int:
    """Restore the scheduler written by `write_trainer_state`; returns the step. A checkpoint of an earlier
    release (`*.pt`) is read with torch's weights-only loader, which refuses anything but tensors and
    plain containers."""
    file = Path(path) / state_file
    try:
        if file.exists():
            extra = json.loads(file.read_text())
        else:
            extra = torch.load(file.with_suffix(".pt"), weights_only=True)
        scheduler.load_state_dict(extra["scheduler"])
        return int(extra.get("step", 0))
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
        raise RuntimeError(f"trainer state {file} cannot be read ({type(e).__name__}: {e})") from e


def merge_partials(per_rank: list[list[dict[str, Any]]], prefix: str = "train") -> dict[str, float]:
    """Per-rank, per-step partial metrics -> one dict: losses summed over ranks (each rank's loss is its
    share of the global loss), metrics token-weighted, then averaged over the optimizer steps. The
    policy's (`train`) also get `perf/rank_update_s`, the slowest rank's optimizer steps; the first
    step's `ratio_check`, where a rank reports one, is the largest deviation of any rank."""
    steps = len(per_rank[0])
    totals: dict[str, float] = {}
    for k in range(steps):
        parts = [r[k] for r in per_rank]
        weight = sum(p["weight"] for p in parts)
        metrics: dict[str, float] = {}
        for p in parts:
            for name, v in p["weighted"].items():
                metrics[f"{prefix}/{name}"] = metrics.get(f"{prefix}/{name}", 0.0) + v / max(weight, 1.0)
        metrics[f"{prefix}/loss"] = sum(p["loss"] for p in parts)
        metrics[f"{prefix}/grad_norm"] = parts[0]["grad_norm"]
        metrics[f"{prefix}/lr"] = parts[0]["lr"]
        if prefix == "train" and all("seconds" in p for p in parts):
            metrics["perf/rank_update_s"] = max(p["seconds"] for p in parts) * steps
        for name, v in metrics.items():
            totals[name] = totals.get(name, 0.0) + v / steps
    for r in per_rank:  # per-rank figures of the step (seconds, memory): the largest of any rank
        for name, v in {**r[0].get("ratio_check", {}), **r[0].get("rank_metrics", {})}.items():
            totals[name] = max(totals.get(name, 0.0), v)
    return totals
