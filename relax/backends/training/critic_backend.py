"""In-process PPO critic (one rank): a value head over the policy's architecture, trained on returns with
the algorithm's value loss. Same micro-batching and exact gradient accumulation as the policy trainer.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import AutoModelForCausalLM

from relax.algorithms.critic import ValueHeadModel
from relax.algorithms.pipeline import ValueLossInputs
from relax.backends.training.torch_backend import DTYPES, lr_lambda, resolve_device
from relax.config.schema import TrainerConfig
from relax.data.batch import TrainBatch, pack_micro_batches, pad_ragged

logger = logging.getLogger(__name__)


def response_values(
    model: ValueHeadModel, batch: TrainBatch, idx: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values [B, T] of the states that emit each response token (position prompt_len + t - 1)."""
    seqs = [batch.prompt_ids[i] + batch.response_ids[i] for i in idx]
    plen = torch.tensor([len(batch.prompt_ids[i]) for i in idx])
    rlen = torch.tensor([len(batch.response_ids[i]) for i in idx])
    L, T = max(len(s) for s in seqs), max(1, int(rlen.max()))
    input_ids = pad_ragged(seqs, L, dtype=torch.long).to(device)
    attn = (torch.arange(L)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]).long().to(device)
    values_BL = model(input_ids=input_ids, attention_mask=attn, use_cache=False).float()  # [B, L]
    pos_BT = (plen[:, None] - 1 + torch.arange(T)[None, :]).clamp(max=L - 1).to(device)
    return values_BL.gather(1, pos_BT), rlen


class TorchCritic:
    def __init__(self, model_path: str, cfg: TrainerConfig, *, dtype: str = "float32", total_steps: int = 1):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        backbone = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])
        self.model = ValueHeadModel(backbone).to(self.device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        steps = total_steps * cfg.num_mini_batches
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, steps))

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [torch.empty(0)] * len(batch)
        for idx in pack_micro_batches(batch.seq_lens(), self.cfg.max_tokens_per_micro_batch):
            values_BT, rlen = response_values(self.model, batch, idx, self.device)
            for row, i in enumerate(idx):
                out[i] = values_BT[row, : rlen[row]].cpu()
        return out

    def train_values(self, batch: TrainBatch, old_values: list[torch.Tensor], loss_fn) -> dict[str, float]:
        if batch.returns is None:
            raise ValueError("critic training needs batch.returns (from compute_advantages)")
        n = len(batch)
        minis = [list(range(n))[k :: self.cfg.num_mini_batches] for k in range(self.cfg.num_mini_batches)]
        totals: dict[str, float] = {}
        for mini in minis:
            self.optimizer.zero_grad(set_to_none=True)
            tokens = float(sum(sum(batch.loss_mask[i]) for i in mini))
            lengths = [len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in mini]
            loss_sum = 0.0
            for local in pack_micro_batches(lengths, self.cfg.max_tokens_per_micro_batch):
                idx = [mini[j] for j in local]
                values_BT, _ = response_values(self.model, batch, idx, self.device)
                T = values_BT.size(1)
                inputs = ValueLossInputs(
                    values=values_BT,
                    old_values=pad_ragged([old_values[i] for i in idx], T).to(self.device),
                    returns=pad_ragged([batch.returns[i] for i in idx], T).to(self.device),
                    loss_mask=pad_ragged([batch.loss_mask[i] for i in idx], T).to(self.device),
                    global_num_tokens=max(tokens, 1.0),
                    global_num_seqs=float(len(mini)),
                    max_response_len=int(max(batch.response_lens()) or 1),
                )
                loss, metrics = loss_fn(inputs)
                loss.backward()
                loss_sum += float(loss.detach())
                for k, v in metrics.items():
                    totals[f"critic/{k}"] = totals.get(f"critic/{k}", 0.0) + float(v) / len(minis)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            if torch.isfinite(grad_norm):
                self.optimizer.step()
            self.scheduler.step()
            totals["critic/loss"] = totals.get("critic/loss", 0.0) + loss_sum / len(minis)
            totals["critic/grad_norm"] = totals.get("critic/grad_norm", 0.0) + float(grad_norm) / len(minis)
        return totals

    def save(self, path: Path) -> None:
        msd, osd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(path) / "dcp"))
        torch.save({"scheduler": self.scheduler.state_dict()}, Path(path) / "critic_state.pt")

    def load(self, path: Path) -> None:
        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        self.scheduler.load_state_dict(torch.load(Path(path) / "critic_state.pt")["scheduler"])
