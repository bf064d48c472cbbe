"""Batched next-token sampling with per-request parameters and per-request random generators.

For each row b with temperature T_b > 0 the sampler computes

    logp_b = log_softmax(logits_b / T_b)            (the reported log-prob of the sampled token)
    p_b    = top_k / top_p / min_p truncation of exp(logp_b), not renormalised
    token  = argmax_v p_b[v] / E_b[v],  E_b[v] ~ Exp(1) drawn from the request's own generator

(the exponential race: equivalent to sampling from p_b / sum p_b). Rows with T_b = 0 are greedy
(argmax of the logits) and report log_softmax(logits) at temperature 1.

The reported log-prob is the one the sampler saw *before* truncation, like SGLang's default
(temperature applied, top-p/top-k not): at T = 1 it equals a trainer's `log_softmax(model(x).logits)`
for the sampled token, which is what off-policy corrections compare against. After truncation the
true behaviour probability is larger by the kept mass's inverse; that choice is deliberate.

A seeded request draws its noise from its own `torch.Generator`, one draw of V values per step, so it
gives the same tokens whatever else is in the batch. Unseeded rows share the engine's generator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


@dataclass
class RowParams:
    """What the sampler needs of one running sequence."""

    temperature: float  # 0 = greedy
    top_p: float  # 1 = off
    top_k: int  # -1 = off
    min_p: float  # 0 = off
    generator: torch.Generator | None  # own stream of a seeded request; None: the engine's shared one


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def truncate_probs(probs_BV: Tensor, top_k_B: Tensor, top_p_B: Tensor, min_p_B: Tensor) -> Tensor:
    """Zero the probabilities that top-k, top-p (nucleus) and min-p exclude; rows are not renormalised.

    top_k_B <= 0 means off; the most likely token is always kept.
    """
    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    V = probs_BV.shape[-1]
    rank_V = torch.arange(V, device=probs_BV.device)
    k_B = torch.where(top_k_B > 0, top_k_B, V)
    drop_BV = rank_V.unsqueeze(0) >= k_B.unsqueeze(1)
    mass_before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV  # mass of strictly more likely tokens
    drop_BV |= mass_before_BV > top_p_B.unsqueeze(1)
    drop_BV |= sorted_BV < (min_p_B * sorted_BV[:, 0]).unsqueeze(1)
    drop_BV[:, 0] = False
    sorted_BV = sorted_BV.masked_fill(drop_BV, 0.0)
    return torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)


def sample_tokens(
    logits_BV: Tensor, rows: list[RowParams], shared: torch.Generator | None = None
) -> tuple[list[int], list[float]]:
    """Sample one token per row; returns (token ids, log-probs of those tokens), both of length B.

    Rows without a generator of their own draw from `shared` (one draw for all of them, so the cost of a
    step does not grow with the number of unseeded rows)."""
    device = logits_BV.device
    temps = [r.temperature for r in rows]
    if all(t <= 0.0 for t in temps):  # all greedy: no noise, log-probs at temperature 1
        tokens_B = logits_BV.argmax(dim=-1)
        logp_BV = torch.log_softmax(logits_BV, dim=-1, dtype=torch.float32)  # upcast inside, no copy
        return _to_lists(tokens_B, logp_BV.gather(1, tokens_B.unsqueeze(1)).squeeze(1))
    scaled_BV = logits_BV  # temperature 1 (and greedy rows, which report temperature 1): no division
    if any(t > 0.0 and t != 1.0 for t in temps):
        temp_B = torch.tensor([t if t > 0.0 else 1.0 for t in temps], device=device)
        scaled_BV = logits_BV.float() / temp_B.unsqueeze(1)
    logp_BV = torch.log_softmax(scaled_BV, dim=-1, dtype=torch.float32)
    probs_BV = logp_BV.exp()
    trunc = [i for i, r in enumerate(rows) if r.top_k > 0 or r.top_p < 1.0 or r.min_p > 0.0]
    if trunc:
        idx = torch.tensor(trunc, device=device)
        sub = [rows[i] for i in trunc]
        probs_BV = probs_BV.index_copy(
            0,
            idx,
            truncate_probs(
                probs_BV.index_select(0, idx),
                torch.tensor([r.top_k for r in sub], device=device),
                torch.tensor([r.top_p for r in sub], device=device),
                torch.tensor([r.min_p for r in sub], device=device),
            ),
        )
    uniform_BV = torch.rand(probs_BV.shape, generator=shared, device=device)
    for i, r in enumerate(rows):
        if r.generator is not None and r.temperature > 0.0:  # a seeded request: its own stream
            uniform_BV[i].uniform_(generator=r.generator)
    # Exp(1) noise; -log(rand) is much cheaper on CPU than exponential_. rand is in [0, 1), so the noise
    # is in (0, inf]: never 0 (no 0/0), and an infinite draw only scores its token 0
    noise_BV = uniform_BV.log_().neg_()
    tokens_B = probs_BV.div_(noise_BV).argmax(dim=-1)
    if any(t <= 0.0 for t in temps):
        greedy_B = torch.tensor([t <= 0.0 for t in temps], dtype=torch.bool, device=device)
        tokens_B = torch.where(greedy_B, logits_BV.argmax(dim=-1), tokens_B)
    logp_B = logp_BV.gather(1, tokens_B.unsqueeze(1)).squeeze(1)
    return _to_lists(tokens_B, logp_B)


def _to_lists(tokens_B: Tensor, logp_B: Tensor) -> tuple[list[int], list[float]]:
    """One device-to-host transfer for both (token ids are exact in float64)."""
    both = torch.stack([tokens_B.double(), logp_B.double()]).cpu().tolist()
    return [int(t) for t in both[0]], both[1]
