"""Samples to data-plane rows and data-plane columns back to a `TrainBatch`.

Column names live in `relax.dataplane.plane`; values are plain Python (lists, floats), so every
data-plane implementation stores them as they are.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from relax.data.batch import TrainBatch
from relax.data.columns import ADVANTAGES, LOG_PROBS, REF_LOG_PROBS, RETURNS
from relax.data.mm_codec import decode_inputs, encode_inputs
from relax.data.sample import Sample

logger = logging.getLogger(__name__)


def sample_to_row(s: Sample) -> dict[str, Any]:
    """The Rollout columns of one sample (`ROLLOUT_COLUMNS`)."""
    return {
        "prompt_ids": list(s.prompt_ids),
        "response_ids": list(s.response_ids),
        "loss_mask": [int(m) for m in (s.loss_mask or [1] * s.response_length)],
        "rollout_log_probs": [float(x) for x in s.rollout_log_probs],
        "reward": float(s.reward if s.reward is not None else 0.0),
        "group_id": int(s.group_id),
        "weight_versions": [int(v) for v in s.weight_versions],
        "length": len(s.prompt_ids) + s.response_length,
        "multimodal_inputs": encode_inputs(s.multimodal_inputs) if s.multimodal_inputs else "",
    }


def samples_to_rows(samples: list[Sample], contexts_per_sample: int = 1) -> list[dict[str, Any]]:
    """Rows of scored samples: one per sample, or with multi-agent contexts one per context
    (`[s, *s.contexts]`), context k of group g getting row group id `g * contexts_per_sample + k`."""
    if contexts_per_sample == 1:
        return [sample_to_row(s) for s in samples]
    rows = []
    for s in samples:
        contexts = [s, *s.contexts]
        if len(contexts) != contexts_per_sample:
            raise ValueError(
                f"sample {s.index}/{s.sample_id} has {len(contexts)} contexts, but "
                f"rollout.agent.contexts_per_sample={contexts_per_sample}"
            )
        for k, ctx in enumerate(contexts):
            row = sample_to_row(ctx)
            row["group_id"] = s.group_id * contexts_per_sample + k
            rows.append(row)
    return rows


def _tensors(values: list[Any] | None) -> list[torch.Tensor] | None:
    if values is None:
        return None
    return [torch.as_tensor(v, dtype=torch.float32).reshape(-1) for v in values]


def batch_from_columns(columns: dict[str, list[Any]]) -> TrainBatch:
    """A `TrainBatch` from data-plane columns; per-token columns other producers wrote fill the
    matching fields (old/ref log-probs, advantages, returns)."""
    batch = TrainBatch(
        prompt_ids=[list(map(int, p)) for p in columns["prompt_ids"]],
        response_ids=[list(map(int, r)) for r in columns["response_ids"]],
        loss_mask=[[float(m) for m in mask] for mask in columns["loss_mask"]],
        rollout_log_probs=[[float(x) for x in lp] for lp in columns["rollout_log_probs"]],
        rewards=[float(r) for r in columns["reward"]],
        group_index=[int(g) for g in columns["group_id"]],
        weight_versions=[min(v) if len(v) else -1 for v in columns["weight_versions"]],
    )
    batch.extras["weight_versions"] = [list(v) for v in columns["weight_versions"]]
    media = columns.get("multimodal_inputs") or []
    if any(media):
        batch.multimodal_inputs = [decode_inputs(m) if m else None for m in media]
    batch.old_log_probs = _tensors(columns.get(LOG_PROBS))
    batch.ref_log_probs = _tensors(columns.get(REF_LOG_PROBS))
    batch.advantages = _tensors(columns.get(ADVANTAGES))
    batch.returns = _tensors(columns.get(RETURNS))
    return batch


def tensor_column(values: list[torch.Tensor]) -> list[list[float]]:
    """Per-token tensors to plain lists for the data plane."""
    return [v.detach().float().cpu().tolist() for v in values]
