"""The rows of a batch that need more than plain sampling: a grammar mask, a logit bias, OpenAI's presence
and frequency penalties or `min_new_tokens`' stop-token mask applied to their logits before sampling, or
the `top_logprobs_num` most likely tokens read after it.

The penalties count the row's generated tokens only (OpenAI's definition; the prompt does not count):
with c[v] the times token v was generated so far,

    logits[v] -= presence_penalty * (c[v] > 0) + frequency_penalty * c[v]

`min_new_tokens`: while the row has fewer outputs, its stop tokens (EOS unless `ignore_eos`, and
`stop_token_ids`) get logit -inf, as SGLang masks them.

The scheduler builds a `LogitRows` when the batch changes and only when a row needs one (`Sequence.
special`); a batch without such rows runs the decode loop unchanged (the overlapped, fused path on
CUDA). A batch with one runs its steps one at a time: a grammar's next mask needs the token just sampled.

The reported log-prob of a constrained row is that of the masked distribution (the tokens the grammar
forbids get probability 0, the rest renormalised): the distribution the token was drawn from.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax.backends.inference.embedded.sampling.grammar import allowed_tokens
from relax.backends.inference.embedded.scheduling.sequence import Sequence, TopLogprobs


class LogitRows:
    def __init__(self, seqs: list[Sequence], vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.masked = [(b, s.matcher) for b, s in enumerate(seqs) if s.matcher is not None]
        self.masked_rows = torch.tensor([b for b, _ in self.masked], dtype=torch.long, device=device)
        self.bias: list[tuple[int, Tensor, Tensor]] = []
        for b, s in enumerate(seqs):
            if s.group.logit_bias:
                ids = torch.tensor(list(s.group.logit_bias), dtype=torch.long, device=device)
                vals = torch.tensor(list(s.group.logit_bias.values()), dtype=torch.float32, device=device)
                self.bias.append((b, ids, vals))
        # (row, its sequence, presence penalty, frequency penalty): counted from its outputs at each step
        self.penalized = [
            (b, s, s.group.params.presence_penalty, s.group.params.frequency_penalty)
            for b, s in enumerate(seqs)
            if s.group.params.presence_penalty or s.group.params.frequency_penalty
        ]
        # (row, its sequence, its stop tokens): masked while it has fewer than min_new_tokens outputs
        self.min_new = [
            (b, s, torch.tensor(sorted(t for t in s.group.stop_ids if t < vocab_size), dtype=torch.long,
                                device=device))
            for b, s in enumerate(seqs)
            if s.group.params.min_new_tokens > 0 and s.group.stop_ids
        ]  # fmt: skip
        # (row, k, temperature of its reported log-probs: 1 for a greedy row)
        self.top = [
            (b, s.group.top_logprobs_num, s.row.temperature if s.row.temperature > 0 else 1.0)
            for b, s in enumerate(seqs)
            if s.group.top_logprobs_num > 0
        ]
        self.rows = len(seqs)

    @classmethod
    def of(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> LogitRows | None:
        """None when no row needs anything (the common case)."""
        if not any(s.special for s in seqs):
            return None
        return cls(seqs, vocab_size, device)

    def process(self, logits_BV: Tensor) -> Tensor:
        """The logits with the masks and biases applied (a new tensor; the input is left as it is)."""
        if not self.masked and not self.bias and not self.penalized and not self.min_new:
            return logits_BV
        out_BV = logits_BV.float() if logits_BV.dtype != torch.float32 else logits_BV.clone()
        if self.masked:
            allowed_RV = allowed_tokens([m for _, m in self.masked], self.vocab_size).to(out_BV.device)
            V = min(out_BV.shape[1], allowed_RV.shape[1])
            sub_RV = out_BV.index_select(0, self.masked_rows)
            sub_RV[:, :V] = sub_RV[:, :V].masked_fill(~allowed_RV[:, :V], float("-inf"))
            sub_RV[:, V:] = float("-inf")  # padding columns past the tokenizer's vocabulary
            out_BV.index_copy_(0, self.masked_rows, sub_RV)
        for b, ids, vals in self.bias:
            out_BV[b].index_add_(0, ids, vals)
        for b, s, presence, frequency in self.penalized:
            if s.output_ids:
                ids_T = torch.tensor(s.output_ids, dtype=torch.long, device=out_BV.device)
                counts_V = torch.bincount(ids_T, minlength=out_BV.shape[1])[: out_BV.shape[1]].float()
                out_BV[b] -= presence * (counts_V > 0).float() + frequency * counts_V
        for b, s, stop_ids in self.min_new:
            if len(s.output_ids) < s.group.params.min_new_tokens:
                row_V = out_BV[b].index_fill(0, stop_ids, float("-inf"))
                # a grammar that allows only a stop token here wins: a row of all -inf cannot be sampled
                if s.matcher is None or bool(torch.isfinite(row_V).any()):
                    out_BV[b] = row_V
        return out_BV

    def top_logprobs(self, logits_BV: Tensor) -> list[TopLogprobs | None]:
        """Per row, its k most likely tokens and their log-probs at its temperature (None for rows that
        did not ask); `logits_BV` are the processed logits the row sampled from."""
        out: list[TopLogprobs | None] = [None] * self.rows
        for b, k, temperature in self.top:
            logp_V = torch.log_softmax(logits_BV[b].float() / temperature, dim=-1)
            vals, ids = logp_V.topk(min(k, logp_V.shape[0]))
            out[b] = list(zip(vals.tolist(), ids.tolist(), strict=True))
        return out
