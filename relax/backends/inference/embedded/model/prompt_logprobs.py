"""Log-probs of prompt tokens (SGLang's `logprob_start_len`, `input_token_logprobs`): what selection among
choices (`sgl.select`) and scoring requests read.

One forward pass of the model over the prompt, without the KV cache (the request's own prefill, if it
generates, is a separate pass; prompt scoring is not RL's hot path). The LM head runs over `CHUNK`
positions at a time, so a long prompt never holds a [T, V] logits tensor.

SGLang's shape: entry k is prompt token `start + k`; its log-prob given the tokens before it, except entry
0, which is always None (as SGLang reports it: the position `start` is scored from the one before it only
when `start` is 0, and then there is none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 512


@dataclass
class PromptLogprobs:
    tokens: list[int]  # prompt tokens from `start` on
    logprobs: list[float | None]  # one per token; the first is None
    top: list[list[tuple[float, int]] | None]  # top-k (log-prob, token id) per position; first None


@torch.inference_mode()
def prompt_logprobs(runner, input_ids: list[int], start: int, top_k: int = 0) -> PromptLogprobs:  # noqa: ANN001
    """`runner`: a `ModelRunner`; `start` in [0, len(input_ids) - 1]."""
    T = len(input_ids)
    if not 0 <= start < T:
        raise ValueError(f"logprob_start_len={start} must be below the prompt's {T} tokens")
    tokens = list(input_ids[start:])
    logprobs: list[float | None] = [None]
    top: list[list[tuple[float, int]] | None] = [None]
    if start < T - 1:
        ids_1T = torch.tensor([input_ids], dtype=torch.long, device=runner.device)
        with runner._attention_kernels():  # noqa: SLF001 - the runner's own kernel choice
            hidden_TH = runner.decoder(input_ids=ids_1T, use_cache=False).last_hidden_state[0]
        targets = torch.tensor(input_ids[start + 1 :], dtype=torch.long, device=runner.device)
        for lo in range(start, T - 1, CHUNK):
            hi = min(lo + CHUNK, T - 1)
            logp_CV = torch.log_softmax(runner._logits(hidden_TH[lo:hi]).float(), dim=-1)  # noqa: SLF001
            chunk_targets = targets[lo - start : hi - start]
            logprobs += logp_CV.gather(1, chunk_targets.unsqueeze(1)).squeeze(1).tolist()
            if top_k > 0:
                vals, ids = logp_CV.topk(min(top_k, logp_CV.shape[1]), dim=-1)
                top += [
                    list(zip(v, i, strict=True)) for v, i in zip(vals.tolist(), ids.tolist(), strict=True)
                ]
    if top_k <= 0:
        top = []
    return PromptLogprobs(tokens, logprobs, top)
