"""Batched next-token sampling with per-request parameters and per-request random generators.

For each row b with temperature T_b > 0 the sampler computes

    logp_b = log_softmax(logits_b / T_b)            (the reported log-prob of the sampled token)
    p_b    = top_k / top_p / min_p truncation of exp(logp_b), not renormalised
    token  = a draw from p_b / sum(p_b), with random numbers from the request's own generator:
             CPU:  the first v with cumsum(p_b)[v] > u_b * sum(p_b),  u_b ~ U[0, 1)   (inverse CDF)
             CUDA: argmax_v p_b[v] / E_b[v],  E_b[v] ~ Exp(1)                       (exponential race)

Both draw exactly from the truncated distribution; they differ in cost. On CUDA with Triton, a batch whose
rows all sample without truncation (the usual RL rollout) takes neither: `fused_sampling.py` does the
log-sum-exp and an inverse-CDF draw in two Triton kernels (parts of each row summed in parallel, then
one part searched). The inverse CDF needs one random
number per row where the race needs one per vocabulary entry, so on the CPU the inverse CDF is the faster;
on a GPU the race is one parallel pass while a row-wise scan over 150k entries is not, so the race is
(docs/measurements.md). A token of probability 0 (truncated, or a
banned media token) is never drawn either way. Rows with T_b = 0 are greedy (argmax of the logits) and
report log_softmax(logits) at temperature 1.

The reported log-prob is the one the sampler saw *before* truncation, like SGLang's default
(temperature applied, top-p/top-k not): at T = 1 it equals a trainer's `log_softmax(model(x).logits)`
for the sampled token, which is what off-policy corrections compare against. After truncation the
true behaviour probability is larger by the kept mass's inverse; that choice is deliberate.

A seeded request draws its numbers from its own `torch.Generator`, so it gives the same tokens whatever
else is in the batch (on the same kind of device). Unseeded rows share the engine's generator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from relax.backends.inference.embedded.sampling import fused_sampling

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


class BatchSampler:
    """The sampling parameters of one batch as tensors, built once while the batch stays the same (the
    scheduler builds a new one when rows join or leave), so a step's sampling is a fixed chain of batched
    ops with no per-row Python work (except the draws of seeded rows)."""

    def __init__(self, rows: list[RowParams], device: torch.device, method: str | None = None) -> None:
        """`method`: `inverse_cdf`, `race` or `fused`; None picks by device: the inverse CDF on the CPU,
        on CUDA the fused kernel where the batch allows it (`fused_sampling.py`), else the race."""
        if method not in (None, "inverse_cdf", "race", "fused"):
            raise ValueError(f"unknown sampling method {method!r}; use inverse_cdf, race or fused")
        self.inverse_cdf = device.type == "cpu" if method is None else method == "inverse_cdf"
        temps = [r.temperature for r in rows]
        self.all_greedy = all(t <= 0.0 for t in temps)  # no noise, log-probs at temperature 1
        self.temp_B1: Tensor | None = None  # None: no division (temperature 1, greedy rows report 1)
        if any(t > 0.0 and t != 1.0 for t in temps):
            self.temp_B1 = torch.tensor([t if t > 0.0 else 1.0 for t in temps], device=device).unsqueeze(1)
        self.greedy_B: Tensor | None = None  # greedy rows of a mixed batch
        if not self.all_greedy and any(t <= 0.0 for t in temps):
            self.greedy_B = torch.tensor([t <= 0.0 for t in temps], dtype=torch.bool, device=device)
        # rows with top-k / top-p / min-p: their index and parameters, or None when no row truncates
        self.trunc: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        trunc = [i for i, r in enumerate(rows) if r.top_k > 0 or r.top_p < 1.0 or r.min_p > 0.0]
        if trunc:
            sub = [rows[i] for i in trunc]
            self.trunc = (
                torch.tensor(trunc, device=device),
                torch.tensor([r.top_k for r in sub], device=device),
                torch.tensor([r.top_p for r in sub], device=device),
                torch.tensor([r.min_p for r in sub], device=device),
            )
        # seeded sampled rows draw from their own stream
        self.seeded = [
            (i, r.generator) for i, r in enumerate(rows) if r.generator is not None and r.temperature > 0.0
        ]
        # one Triton pass per row: every row sampled (no greedy row), none truncated
        fusable = device.type == "cuda" and all(t > 0.0 for t in temps) and self.trunc is None
        if method == "fused" and not (fusable and fused_sampling.available()):
            raise ValueError("the fused sampler needs CUDA, Triton, and rows sampled without truncation")
        self.inv_temp_B: Tensor | None = None
        if fusable and method in (None, "fused") and fused_sampling.available():
            self.inv_temp_B = torch.tensor([1.0 / t for t in temps], dtype=torch.float32, device=device)

    @torch.inference_mode()
    def sample(self, logits_BV: Tensor, shared: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Sample one token per row; returns the token ids [B] and their log-probs [B] (float32).

        Rows without a generator of their own draw from `shared` (one draw for all of them, so the cost
        of a step does not grow with the number of unseeded rows)."""
        if self.inv_temp_B is not None:
            seeds_B = fused_sampling.draw_seeds(len(self.inv_temp_B), self.seeded, shared, logits_BV.device)
            return fused_sampling.fused_sample(logits_BV, self.inv_temp_B, seeds_B)
        if self.all_greedy:
            tokens_B = logits_BV.argmax(dim=-1)
            logp_BV = torch.log_softmax(logits_BV, dim=-1, dtype=torch.float32)  # upcast inside, no copy
            return tokens_B, logp_BV.gather(1, tokens_B.unsqueeze(1)).squeeze(1)
        scaled_BV = logits_BV if self.temp_B1 is None else logits_BV.float() / self.temp_B1
        logp_BV = torch.log_softmax(scaled_BV, dim=-1, dtype=torch.float32)
        probs_BV = logp_BV.exp()
        if self.trunc is not None:
            idx, top_k, top_p, min_p = self.trunc
            probs_BV = probs_BV.index_copy(
                0, idx, truncate_probs(probs_BV.index_select(0, idx), top_k, top_p, min_p)
            )
        if self.inverse_cdf:
            tokens_B = self._inverse_cdf(probs_BV, shared)
        else:
            tokens_B = self._race(probs_BV, shared)
        if self.greedy_B is not None:
            tokens_B = torch.where(self.greedy_B, logits_BV.argmax(dim=-1), tokens_B)
        return tokens_B, logp_BV.gather(1, tokens_B.unsqueeze(1)).squeeze(1)

    def _race(self, probs_BV: Tensor, shared: torch.Generator | None) -> Tensor:
        """One token per row by the exponential race: argmax_v p[v] / E[v], E[v] ~ Exp(1)."""
        uniform_BV = torch.rand(probs_BV.shape, generator=shared, device=probs_BV.device)
        for i, gen in self.seeded:
            uniform_BV[i].uniform_(generator=gen)
        # E = -log(rand); argmax p / E is taken as argmin p / log(rand) (the same values negated, same
        # ties), one op fewer. rand is in [0, 1), so E is in (0, inf]: never 0 (no 0/0), and an infinite
        # draw only scores its token 0
        return probs_BV.div_(uniform_BV.log_()).argmin(dim=-1)

    def _inverse_cdf(self, probs_BV: Tensor, shared: torch.Generator | None) -> Tensor:
        """One token per row drawn from the unnormalised `probs_BV` with one uniform number per row."""
        B = probs_BV.shape[0]
        u_B = torch.rand(B, generator=shared, device=probs_BV.device, dtype=torch.float64)
        for i, gen in self.seeded:
            u_B[i : i + 1].uniform_(generator=gen)
        # float64: in float32 the CDF near 1 moves in steps of 6e-8, coarse against the 7e-6 of one token
        # of a near-uniform 150k vocabulary
        cdf_BV = probs_BV.cumsum(dim=-1, dtype=torch.float64)
        total_B = cdf_BV[:, -1]
        # should u * total round up to total, keep the target strictly below it, so that the search
        # always lands on a token whose CDF step (its probability) is positive
        target_B = torch.minimum(u_B * total_B, torch.nextafter(total_B, torch.zeros_like(total_B)))
        tokens_B = torch.searchsorted(cdf_BV, target_B.unsqueeze(1), right=True).squeeze(1)
        # a row whose probabilities are NaN (non-finite logits) searches past the end: keep its index in
        # the vocabulary so that one bad row cannot fail the gather, and so the step, of the whole batch
        return tokens_B.clamp_(max=probs_BV.shape[-1] - 1)


def sample_tokens(
    logits_BV: Tensor, rows: list[RowParams], shared: torch.Generator | None = None
) -> tuple[list[int], list[float]]:
    """Sample one token per row (`BatchSampler` of `rows`); returns (token ids, log-probs), both of
    length B."""
    return to_lists(*BatchSampler(rows, logits_BV.device).sample(logits_BV, shared))


def to_lists(tokens_B: Tensor, logp_B: Tensor) -> tuple[list[int], list[float]]:
    """Token ids and log-probs as Python lists; off the CPU in one device-to-host transfer (token ids
    are exact in float64)."""
    if tokens_B.device.type == "cpu":
        return tokens_B.tolist(), logp_B.tolist()
    both = torch.stack([tokens_B.double(), logp_B.double()]).cpu().tolist()
    return [int(t) for t in both[0]], both[1]
