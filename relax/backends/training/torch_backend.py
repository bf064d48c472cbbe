"""In-process PyTorch training backend (one rank): log-probs, token-budget micro-batches, AdamW, checkpoints.

The loss is handed in (`loss_fn`); this module knows nothing of the algorithm. Gradient accumulation is
exact because the loss function scales each micro-batch's loss by the global batch's token/sequence counts.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from relax.algorithms.pipeline import PolicyLossInputs
from relax.backends.training.base import LossFn, RatioCheck, has_behaviour
from relax.backends.training.logprobs import (
    decoder_hidden,
    plain_head,
    ragged_index,
    scatter_padded,
    token_logprobs,
)
from relax.backends.training.packing import packed_response_states, should_pack
from relax.config.schema import TrainerConfig
from relax.data.batch import TrainBatch, pack_micro_batches, pad_ragged
from relax.models.multimodal_model import banned_token_ids, load_causal_lm, mask_media_logits, model_inputs

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lr_lambda(cfg: TrainerConfig, total_steps: int):
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


def response_log_probs(
    model: torch.nn.Module,
    batch: TrainBatch,
    idx: list[int],
    device: torch.device,
    with_entropy: bool,
    pack: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Forward samples `idx`; return log-probs [B,T] and entropy [B,T] of response tokens (zero past each
    response), and T-lengths. A plain lm head runs chunked on the response positions (`logprobs`);
    text-only samples run packed into one row where `pack` (`trainer.pack_sequences`) says so."""
    seqs = [batch.prompt_ids[i] + batch.response_ids[i] for i in idx]
    plen = torch.tensor([len(batch.prompt_ids[i]) for i in idx])
    rlen = torch.tensor([len(batch.response_ids[i]) for i in idx])
    lens = [len(s) for s in seqs]
    T = max(1, int(rlen.max()))
    media = batch.media_rows(idx)
    head = plain_head(model)
    if head is not None and not media and should_pack(model, lens, pack):
        ids_N = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
        states_MH, targets_M, rows_M, cols_M = packed_response_states(model, ids_N, torch.tensor(lens), rlen)
        logp_M, ent_M = token_logprobs(
            states_MH, head.weight, targets_M, with_entropy=with_entropy, banned=banned_token_ids(model)
        )
        ent_BT = None if ent_M is None else scatter_padded(ent_M, rows_M, cols_M, (len(idx), T))
        return scatter_padded(logp_M, rows_M, cols_M, (len(idx), T)), ent_BT, rlen
    L = max(lens)
    input_ids = pad_ragged(seqs, L, dtype=torch.long).to(device)  # [B, L]
    attn = (torch.arange(L)[None, :] < torch.tensor(lens)[:, None]).long().to(device)
    extra = model_inputs(model, input_ids, attn, media) if media else {}  # media tensors, mrope positions
    if head is not None:  # chunked head over the response positions: no [B, L, V] logits
        hidden_BLH = decoder_hidden(model, input_ids=input_ids, attention_mask=attn, **extra)
        rows_N, cols_N = ragged_index(rlen)
        pos_N = plen[rows_N] - 1 + cols_N  # response token t of row b sits at plen_b + t
        rows_N, cols_N, pos_N = (t.to(device) for t in (rows_N, cols_N, pos_N))
        logp_N, ent_N = token_logprobs(
            hidden_BLH[rows_N, pos_N],
            head.weight,
            input_ids[rows_N, pos_N + 1],
            with_entropy=with_entropy,
            banned=banned_token_ids(model),
        )
        ent_BT = None if ent_N is None else scatter_padded(ent_N, rows_N, cols_N, (len(idx), T))
        return scatter_padded(logp_N, rows_N, cols_N, (len(idx), T)), ent_BT, rlen
    logits = model(
        input_ids=input_ids, attention_mask=attn, use_cache=False, **extra
    ).logits.float()  # [B, L, V]
    # Token at position p is predicted by logits at p-1: response token t sits at plen+t.
    pos_BT = (plen[:, None] - 1 + torch.arange(T)[None, :]).clamp(max=L - 2).to(device)  # [B, T]
    logits_BTV = mask_media_logits(
        logits.gather(1, pos_BT[..., None].expand(-1, -1, logits.size(-1))), banned_token_ids(model)
    )
    targets_BT = input_ids.gather(1, (pos_BT + 1))
    logp_BTV = torch.log_softmax(logits_BTV, dim=-1)
    logp_BT = logp_BTV.gather(-1, targets_BT[..., None]).squeeze(-1)
    entropy_BT = -(logp_BTV.exp() * logp_BTV).sum(-1) if with_entropy else None
    return logp_BT, entropy_BT, rlen


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder (and vision) layer's activations in backward; needs `model.train()`.

    transformers >= 5.2 names it `activation_checkpointing_enable` (the old name warns); both take the
    `torch.utils.checkpoint` options, here the non-reentrant variant that FSDP2 and `torch.compile` need.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


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
        self.device = resolve_device(cfg.device)
        self.model = load_causal_lm(model_path, dtype=DTYPES[dtype]).to(self.device)
        self.model.train()
        if cfg.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        self.ref_model = None
        if with_reference:
            self.ref_model = load_causal_lm(reference_path or model_path, dtype=DTYPES[dtype])
            self.ref_model.to(self.device).eval().requires_grad_(False)
        # fused: one pass over all parameters (CPU and CUDA) instead of ~20 small ops per tensor; on the
        # CPU's default single-tensor path that was a tenth of a small model's training step
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True
        )
        steps = total_steps * cfg.num_mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, steps))
        # Training steps taken (each is num_mini_batches optimizer steps): the weight version of the
        # current parameters, the step a checkpoint resumes at, and what staleness is counted in.
        self.step = 0

    # -- forward-only ------------------------------------------------------------------------
    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, *, reference: bool = False) -> list[torch.Tensor]:
        model = self.ref_model if reference else self.model
        if model is None:
            raise RuntimeError("reference log-probs requested but the trainer was built without a reference")
        out: list[torch.Tensor] = [torch.empty(0)] * len(batch)
        for idx in pack_micro_batches(batch.seq_lens(), self.cfg.max_tokens_per_micro_batch):
            logp_BT, _, rlen = response_log_probs(
                model, batch, idx, self.device, with_entropy=False, pack=self.cfg.pack_sequences
            )
            for row, i in enumerate(idx):
                out[i] = logp_BT[row, : rlen[row]].cpu()
        return out

    # -- training ----------------------------------------------------------------------------
    def train_batch(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        if batch.advantages is None or batch.old_log_probs is None:
            raise ValueError("train_batch needs batch.advantages and batch.old_log_probs filled in")
        n = len(batch)
        minis = [list(range(n))[k :: self.cfg.num_mini_batches] for k in range(self.cfg.num_mini_batches)]
        totals: dict[str, float] = {}
        check = RatioCheck()
        for k, mini in enumerate(minis):
            metrics = self._optimizer_step(batch, mini, loss_fn, check if k == 0 else None)
            for name, v in metrics.items():
                totals[name] = totals.get(name, 0.0) + v / len(minis)
        self.step += 1
        return {**totals, **check.result()}

    def _optimizer_step(
        self, batch: TrainBatch, mini: list[int], loss_fn: LossFn, check: RatioCheck | None
    ) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        global_tokens = float(sum(sum(batch.loss_mask[i]) for i in mini))
        lengths = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in mini]
        loss_total, weighted, weight_sum = 0.0, {}, 0.0
        for local in pack_micro_batches(lengths, self.cfg.max_tokens_per_micro_batch):
            idx = [mini[j] for j in local]
            logp_BT, ent_BT, rlen = response_log_probs(
                self.model, batch, idx, self.device, with_entropy=True, pack=self.cfg.pack_sequences
            )
            T = logp_BT.size(1)

            def col(rows, idx=idx, T=T):
                return pad_ragged([rows[i] for i in idx], T).to(self.device)

            inputs = PolicyLossInputs(
                log_probs=logp_BT,
                old_log_probs=col(batch.old_log_probs),
                advantages=col(batch.advantages),
                loss_mask=col(batch.loss_mask),
                rollout_log_probs=col(batch.rollout_log_probs),
                ref_log_probs=col(batch.ref_log_probs) if batch.ref_log_probs is not None else None,
                entropy=ent_BT,
                global_num_tokens=max(global_tokens, 1.0),
                global_num_seqs=float(len(mini)),
                max_response_len=int(max(batch.response_lens()) or 1),
            )
            if check is not None:
                check.add(inputs, has_behaviour(batch, idx))
            loss, metrics = loss_fn(inputs)
            loss.backward()
            loss_total += float(loss.detach())
            w = float(inputs.loss_mask.sum())
            weight_sum += w
            for k, v in metrics.items():
                weighted[k] = weighted.get(k, 0.0) + float(v) * w
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning("non-finite grad norm %s at step %d: update skipped", grad_norm, self.step)
        self.scheduler.step()
        out = {f"train/{k}": v / max(weight_sum, 1.0) for k, v in weighted.items()}
        out.update({"train/loss": loss_total, "train/grad_norm": float(grad_norm), "train/lr": lr})
        return out

    # -- weights and checkpoints ---------------------------------------------------------------
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def save(self, path: Path) -> None:
        path = Path(path)
        msd, osd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path / "dcp"))
        extra = {"step": self.step, "scheduler": self.scheduler.state_dict()}
        torch.save(extra, path / "trainer_state.pt")
        (path / "trainer.json").write_text(json.dumps({"step": self.step}))

    def load(self, path: Path) -> None:
        path = Path(path)
        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        extra = torch.load(path / "trainer_state.pt", weights_only=False)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.step = int(extra["step"])
        logger.info("trainer restored from %s at step %d", path, self.step)
