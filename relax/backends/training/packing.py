"""Sequence packing for the training forwards: a micro-batch's samples concatenated into one row, with
position ids that restart at each sample, instead of a [B, L] block padded to the longest.

RL batches are ragged: with a long-tailed response length most samples are far shorter than the longest,
and a padded forward spends its compute on padding (on the modes benchmark's toy task, 3.5 tokens of
every 4). Packed, the body runs on the real tokens only. `transformers` reads packing from the position
ids when no attention mask is passed: flash-attention kernels then run variable-length attention, SDPA
and eager attention get a block-diagonal causal mask over the packed row ([N, N] booleans, so
`auto` packs those only up to `DENSE_MAX_TOKENS`). Only the states that predict response tokens are
taken from the body's output, as in the padded paths (`logprobs.token_logprobs` applies the head).

`trainer.pack_sequences`: `on`, `off`, or `auto` (flash attention: always; SDPA / eager: when the
padded block would be at least `MIN_PADDING_SAVING` larger than the packed row and the packed row is at
most `DENSE_MAX_TOKENS`). Media rows (multimodal models: mrope positions) always run padded.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from relax.backends.training.logprobs import decoder_hidden, ragged_index

DENSE_MAX_TOKENS = 4096  # a packed row's [N, N] mask and attention stay small next to the layers' work
MIN_PADDING_SAVING = 1.25  # padded tokens / packed tokens at which auto packs


def should_pack(model: nn.Module, seq_lens: list[int], mode: str) -> bool:
    """Whether a micro-batch of sequences of `seq_lens` tokens runs packed under `mode` (see above)."""
    if mode == "off" or not seq_lens:
        return False
    if mode == "on":
        return True
    impl = str(getattr(model.config, "_attn_implementation", "") or "")
    if "flash" in impl:
        return True
    packed = sum(seq_lens)
    return packed <= DENSE_MAX_TOKENS and len(seq_lens) * max(seq_lens) >= MIN_PADDING_SAVING * packed


def packed_response_states(
    model: nn.Module, ids_N: Tensor, seq_lens_B: Tensor, response_lens_B: Tensor, multiple: int = 1
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Forward B sequences packed into one row and pick out their response positions.

    ids_N: the B sequences' tokens (prompt then response) one after another, on the model's device;
    seq_lens_B and response_lens_B (cpu). Returns the hidden states that predict the response tokens
    [M, H] (M = sum of response lengths), the tokens they predict [M], and the (row, column) of each in
    a [B, T] response block. `multiple`: the row is padded to a multiple of it with one more sequence
    of padding tokens (positions from 0, so it attends only to itself and no response reads it)."""
    device = ids_N.device
    ends_B = seq_lens_B.cumsum(0)
    starts_N = torch.repeat_interleave(ends_B - seq_lens_B, seq_lens_B)
    pos_N = torch.arange(int(ends_B[-1])) - starts_N  # 0.. within each sequence
    pad = -int(ends_B[-1]) % multiple
    if pad:
        ids_N = torch.cat([ids_N, ids_N.new_zeros(pad)])
        pos_N = torch.cat([pos_N, torch.arange(pad)])
    rows_M, cols_M = ragged_index(response_lens_B)
    nb = dict(non_blocking=True)  # host-built indices: queued, not waited for
    at_M = (ends_B[rows_M] - response_lens_B[rows_M] + cols_M - 1).to(device, **nb)  # predicts token at_M + 1
    hidden_NH = decoder_hidden(model, input_ids=ids_N[None], position_ids=pos_N.to(device, **nb)[None])[0]
    return hidden_NH[at_M], ids_N[at_M + 1], rows_M.to(device, **nb), cols_M.to(device, **nb)
