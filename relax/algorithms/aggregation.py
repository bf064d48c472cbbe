r"""Loss aggregation: per-token loss [B, T] of ONE micro-batch -> its share of the global-batch loss.

Every reducer divides by a GLOBAL count (tokens or sequences of the whole global batch, over all
ranks and micro-batches), never by a micro-batch count, so that summing the returned scalars over
all micro-batches and ranks (gradient accumulation + data-parallel all-reduce SUM) gives exactly the
loss of one big batch. With :math:`l_{it}` the loss and :math:`m_{it}` the mask, N sequences,
M masked tokens, T_max the max response length of the global batch:

* token_mean:              :math:`\sum_{it} m l / M`                       (DAPO token-level loss)
* seq_mean_token_mean:     :math:`\frac1N \sum_i \sum_t m l / \sum_t m`     (GRPO paper, GSPO)
* seq_mean_token_sum:      :math:`\frac1N \sum_i \sum_t m l`
* seq_mean_token_sum_norm: :math:`\frac{1}{N\,T_{max}} \sum_{it} m l`       (Dr. GRPO)
* custom:                  a ``CustomReducer`` loaded from ``package.module:function``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import Protocol

from torch import Tensor

from relax.algorithms.masked import masked_sum


class CustomReducer(Protocol):
    """Contract of a user reducer: return this micro-batch's SHARE of the global loss (a scalar) such
    that summing it over all micro-batches and ranks gives the global-batch loss; divide by the global
    counts given, never by micro-batch counts."""

    def __call__(
        self,
        loss_BT: Tensor,
        mask_BT: Tensor,
        *,
        global_num_tokens: float,
        global_num_seqs: float,
        max_response_len: int,
    ) -> Tensor: ...


def token_mean(loss_BT: Tensor, mask_BT: Tensor, *, global_num_tokens: float, **_: float) -> Tensor:
    """Sum of masked token losses over the global number of masked tokens."""
    return masked_sum(loss_BT, mask_BT) / max(global_num_tokens, 1.0)


def seq_mean_token_mean(loss_BT: Tensor, mask_BT: Tensor, *, global_num_seqs: float, **_: float) -> Tensor:
    """Per-sequence token mean, summed over sequences, over the global number of sequences.

    A fully masked row contributes 0 (it still counts in ``global_num_seqs``)."""
    per_seq_B = masked_sum(loss_BT, mask_BT, dim=-1) / mask_BT.sum(-1).clamp(min=1)
    return per_seq_B.sum() / max(global_num_seqs, 1.0)


def seq_mean_token_sum(loss_BT: Tensor, mask_BT: Tensor, *, global_num_seqs: float, **_: float) -> Tensor:
    """Per-sequence token sum, summed over sequences, over the global number of sequences."""
    return masked_sum(loss_BT, mask_BT) / max(global_num_seqs, 1.0)


def seq_mean_token_sum_norm(
    loss_BT: Tensor, mask_BT: Tensor, *, global_num_seqs: float, max_response_len: int, **_: float
) -> Tensor:
    """Dr. GRPO: token sum over a constant (global_num_seqs * max_response_len); no length bias."""
    return masked_sum(loss_BT, mask_BT) / (max(global_num_seqs, 1.0) * max(max_response_len, 1))


Reducer = Callable[..., Tensor]

# To add a built-in mode: write the reducer above, register it here and in config.LossAggMode.
REDUCERS: dict[str, Reducer] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}


@cache
def load_reducer(path: str) -> Reducer:
    """Import ``package.module:function``; errors say what is wrong with the path."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"custom reducer path {path!r} must look like 'package.module:function'")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"custom reducer {path!r}: {attr!r} is not a callable in {module_name!r}")
    return fn


def get_reducer(mode: str, custom_path: str | None = None) -> Reducer:
    """The reducer for ``mode`` ('custom' loads ``custom_path``); unknown modes raise listing valid ones."""
    if mode == "custom":
        if not custom_path:
            raise ValueError("loss_agg_mode='custom' needs custom_loss_agg='package.module:function'")
        return load_reducer(custom_path)
    if mode not in REDUCERS:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join([*REDUCERS, 'custom'])}")
    return REDUCERS[mode]


def aggregate_loss(
    loss_BT: Tensor,
    mask_BT: Tensor,
    mode: str,
    *,
    global_num_tokens: float,
    global_num_seqs: float,
    max_response_len: int,
    custom_path: str | None = None,
) -> Tensor:
    """This micro-batch's share of the global loss under ``mode`` (see the module docstring)."""
    reducer = get_reducer(mode, custom_path)
    return reducer(
        loss_BT,
        mask_BT,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        max_response_len=max_response_len,
    )
