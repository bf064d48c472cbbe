"""One micro-batch through the model: padded inputs in, response log-probs / entropy / values out.

Two layouts. Text rows are RIGHT-padded and run without an attention mask: under causal attention a real
token never sees the padding after it, so the result is exact, and with no mask SDPA takes its flash
(causal) kernel instead of a masked one. Rows with media (mrope positions from the model's own rope
index) and models whose head is not a plain Linear are LEFT-padded with a mask, so that every response
ends at the last position and the model computes logits only for the last T+1 positions
(`logits_to_keep`), never for the prompt: with a 151k vocabulary the logits are most of the activation
memory. Outputs come back left-aligned either way, [B, T] with response token t in column t and zeros
past each response, as `PolicyLossInputs` expects.

Log-probs and entropy are written from the log-sum-exp, so no [B, T, V] log-softmax copy is kept:
:math:`\\log p(y_t) = z_{y_t} - \\mathrm{lse}(z)` and :math:`H = \\mathrm{lse}(z) - \\sum_v p_v z_v`.
With a plain lm head not even the logits are: the model hands back its decoder's hidden states and
`logprobs.token_logprobs` applies the head to the N response positions a chunk of tokens at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from relax.backends.training import logprobs as lp
from relax.backends.training.packing import packed_response_states, should_pack
from relax.data.batch import Ragged, TrainBatch, flat_tensor
from relax.models.media_dedup import expanding_media
from relax.models.multimodal_model import banned_token_ids, mask_media_logits, model_inputs

logger = logging.getLogger(__name__)

# On a GPU a micro-batch's sequence length is rounded up to a multiple of this: bf16 tensor-core tiles
# want it, and inductor specializes the compiled decoder layers (`trainer.compile_layers`) on whether
# the length is 8-aligned, so ragged lengths would compile every layer graph twice.
CUDA_SEQ_MULTIPLE = 8


def seq_multiple(device: torch.device) -> int:
    """The multiple that sequence lengths on `device` are padded to (`CUDA_SEQ_MULTIPLE` on a GPU)."""
    return CUDA_SEQ_MULTIPLE if device.type == "cuda" else 1


@dataclass
class MicroBatch:
    """Model inputs of a few samples of a (rank-local) batch, padded to the longest."""

    input_ids: Tensor  # [B, L] prompt + response tokens, padded with 0 (left, or right if `right`)
    attention_mask: Tensor  # [B, L] 1 on real tokens
    position_ids: Tensor  # [B, L] 0.. from each row's first real token
    response_lens: Tensor  # [B] (cpu) response length R_b
    T: int  # longest response (>= 1)
    index: list[int]  # rows of the batch; empty for a dummy micro-batch
    media: list[dict[str, Tensor] | None] | None = None  # per-row media tensors (multimodal models)
    right: bool = False  # right-padded: the model runs without an attention mask (text rows only)
    seq_lens: Tensor | None = None  # [B] (cpu) real tokens per row

    @property
    def num_tokens(self) -> int:
        return int(self.seq_lens.sum()) if self.seq_lens is not None else int(self.attention_mask.sum())


def build_micro_batch(
    batch: TrainBatch | None, idx: list[int], device: torch.device, right: bool = False
) -> MicroBatch:
    """Inputs for rows `idx` of `batch`; `batch=None` gives a one-token dummy (keeps ranks in lockstep).
    `right`: right-padded, for text rows only (`micro_batch` chooses)."""
    if batch is None:
        seqs, rlen, idx = [[0, 0]], [1], []
    else:
        seqs = [batch.prompt_ids[i] + batch.response_ids[i] for i in idx]
        rlen = [len(batch.response_ids[i]) for i in idx]
    media = batch.media_rows(list(idx)) if batch is not None else None
    if right and media:
        raise ValueError("rows with media run left-padded with a mask (their mrope positions need it)")
    lens = torch.tensor([len(s) for s in seqs])
    multiple = seq_multiple(device)
    L = -(-int(lens.max()) // multiple) * multiple  # padding columns carry no mask and no positions read
    cols = torch.arange(L)[None, :]
    real = (cols < lens[:, None]) if right else (cols >= (L - lens)[:, None])  # [B, L]
    input_ids = torch.zeros(len(seqs), L, dtype=torch.long)
    input_ids[real] = flat_tensor(seqs, torch.long)  # row-major: in order
    attn = real.long()
    # right: 0..L-1 on every row (the padding after a row's tokens changes nothing before it)
    position_ids = cols.expand(len(seqs), L) if right else (attn.cumsum(-1) - 1).clamp(min=0)
    return MicroBatch(
        input_ids.to(device, non_blocking=True),
        attn.to(device, non_blocking=True),
        position_ids.to(device, non_blocking=True),
        torch.tensor(rlen),
        max(1, max(rlen)),
        list(idx),
        media,
        right,
        lens,
    )


def right_padded(model: nn.Module, batch: TrainBatch | None, idx: list[int]) -> bool:
    """Whether rows `idx` run right-padded without a mask: text rows through a plain lm head or a value
    head (both read the states they need by index); media rows and other heads run left-padded."""
    if batch is not None and batch.media_rows(idx):
        return False
    return hasattr(model, "value_head") or lp.plain_head(model) is not None


def micro_batch(
    model: nn.Module, batch: TrainBatch | None, idx: list[int] | None, device: torch.device
) -> MicroBatch:
    """The inputs of rows `idx` of `batch` in the layout `model` runs best (`idx=None`: a dummy)."""
    rows = idx or []
    source = batch if idx is not None else None
    return build_micro_batch(source, rows, device, right=right_padded(model, source, rows))


def response_positions(mb: MicroBatch) -> tuple[Tensor, Tensor, Tensor]:
    """(row, column, position) of every response token (column t of row b), each [N] on the device:
    position holds the state that predicts the token, which sits at position + 1."""
    rows_N, cols_N = lp.ragged_index(mb.response_lens)
    if mb.right:
        plen_B = mb.seq_lens - mb.response_lens
        pos_N = plen_B[rows_N] - 1 + cols_N
    else:
        pos_N = mb.input_ids.size(1) - 1 - mb.response_lens[rows_N] + cols_N
    device = mb.input_ids.device
    nb = dict(non_blocking=True)  # a blocking copy would wait for the stream: the previous micro-batch
    return rows_N.to(device, **nb), cols_N.to(device, **nb), pos_N.to(device, **nb)


def left_align(x_BT: Tensor, response_lens: Tensor) -> Tensor:
    """Right-aligned rows (response ends at column T-1) -> left-aligned, zero past each response."""
    T = x_BT.size(1)
    cols = torch.arange(T)[None, :]
    src = (T - response_lens[:, None] + cols).clamp(0, T - 1).to(x_BT.device, non_blocking=True)  # [B, T]
    valid = (cols < response_lens[:, None]).to(x_BT.device, non_blocking=True)
    return torch.where(valid, x_BT.gather(1, src), torch.zeros((), dtype=x_BT.dtype, device=x_BT.device))


def policy_forward(
    model: nn.Module, mb: MicroBatch, with_entropy: bool, pack: str = "auto"
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [B, T] (and entropy [B, T]) of the response tokens, with grad if grad is enabled.
    Rows with media also pass their tensors and the model's mrope positions; each distinct image, video
    or audio of the micro-batch is encoded once (GRPO repeats a prompt's media in all its samples).

    With a plain lm head (`logprobs.plain_head`) the model returns its decoder's hidden states and the
    head runs chunked over the response positions only (`logprobs.token_logprobs`); the entropy's
    gradient is computed only if the loss uses it. Otherwise the model's own logits are used. Text-only
    micro-batches run packed into one row where `pack` (`trainer.pack_sequences`) says so."""
    kwargs: dict = {"position_ids": mb.position_ids}
    plan = None
    if mb.media:
        kwargs, plan = model_inputs(model, mb.input_ids, mb.attention_mask, mb.media, dedupe=True)
    head = lp.plain_head(model)
    with expanding_media(model, plan):
        if head is None:
            return _policy_forward_logits(model, mb, with_entropy, kwargs)
        seq_lens = mb.seq_lens if mb.seq_lens is not None else mb.attention_mask.sum(-1).cpu()
        if not mb.media and should_pack(model, seq_lens.tolist(), pack):
            ids_N = mb.input_ids[mb.attention_mask.bool()]  # row by row: the sequences one after another
            states, targets, rows_M, cols_M = packed_response_states(
                model, ids_N, seq_lens, mb.response_lens, multiple=seq_multiple(ids_N.device)
            )
            logp_M, ent_M = lp.token_logprobs(
                states, head.weight, targets, with_entropy=with_entropy, banned=banned_token_ids(model)
            )
            shape = (mb.input_ids.size(0), mb.T)
            ent_BT = None if ent_M is None else lp.scatter_padded(ent_M, rows_M, cols_M, shape)
            return lp.scatter_padded(logp_M, rows_M, cols_M, shape), ent_BT
        mask = None if mb.right else mb.attention_mask
        hidden_BLH = lp.decoder_hidden(model, input_ids=mb.input_ids, attention_mask=mask, **kwargs)
    rows_N, cols_N, pos_N = response_positions(mb)
    logp_N, ent_N = lp.token_logprobs(
        hidden_BLH[rows_N, pos_N],  # [N, H]: the states that predict the response tokens
        head.weight,  # read after the forward: FSDP2 keeps the root's parameters gathered until backward
        mb.input_ids[rows_N, pos_N + 1],
        with_entropy=with_entropy,
        banned=banned_token_ids(model),
    )
    shape = (mb.input_ids.size(0), mb.T)
    ent_BT = None if ent_N is None else lp.scatter_padded(ent_N, rows_N, cols_N, shape)
    return lp.scatter_padded(logp_N, rows_N, cols_N, shape), ent_BT


def _policy_forward_logits(
    model: nn.Module, mb: MicroBatch, with_entropy: bool, kwargs: dict
) -> tuple[Tensor, Tensor | None]:
    """`policy_forward` from the model's own [B, T, V] logits (heads that are not a plain Linear)."""
    out = model(
        input_ids=mb.input_ids,
        attention_mask=mb.attention_mask,
        use_cache=False,
        logits_to_keep=mb.T + 1,
        **kwargs,
    )
    # position p predicts token p+1; the slice also covers models that ignore logits_to_keep (Omni)
    logits_BTV = mask_media_logits(out.logits[:, -(mb.T + 1) : -1].float(), banned_token_ids(model))
    targets_BT = mb.input_ids[:, -mb.T :]
    lse_BT = torch.logsumexp(logits_BTV, dim=-1)
    logp_BT = logits_BTV.gather(-1, targets_BT[..., None]).squeeze(-1) - lse_BT
    entropy_BT = None
    if with_entropy:
        entropy_BT = lse_BT - (torch.softmax(logits_BTV, dim=-1) * logits_BTV).sum(-1)
        entropy_BT = left_align(entropy_BT, mb.response_lens)
    return left_align(logp_BT, mb.response_lens), entropy_BT


def value_forward(model: nn.Module, mb: MicroBatch) -> Tensor:
    """Critic values [B, T] of the states that emit each response token (a `ValueHeadModel`; its backbone
    computes logits for one position only, the values come from the hidden states)."""
    values_BL = model(
        input_ids=mb.input_ids,
        attention_mask=None if mb.right else mb.attention_mask,
        position_ids=mb.position_ids,
        logits_to_keep=1,
    )
    if mb.right:
        rows_N, cols_N, pos_N = response_positions(mb)
        return lp.scatter_padded(values_BL[rows_N, pos_N].float(), rows_N, cols_N, (values_BL.size(0), mb.T))
    return left_align(values_BL[:, -mb.T - 1 : -1].float(), mb.response_lens)


def split_rows(x_BT: Tensor, mb: MicroBatch) -> dict[int, Tensor]:
    """{batch row: its [R_b] slice on cpu} for a forward-only result: one device-to-host copy for the
    micro-batch, then the rows as views of one tensor of their tokens."""
    return RowsToHost().add(x_BT, mb).rows()


class RowsToHost:
    """Forward-only results of a pass's micro-batches, copied to the host without waiting: each copy
    is queued behind its micro-batch's kernels into pinned memory (on a GPU), and `rows` waits once for
    all of them. A blocking copy per micro-batch would leave the GPU idle while the host builds the next
    micro-batch's inputs."""

    def __init__(self) -> None:
        self._parts: list[tuple[Tensor, MicroBatch]] = []
        self._done: torch.cuda.Event | None = None

    def add(self, x_BT: Tensor, mb: MicroBatch) -> RowsToHost:
        if not mb.index:  # a dummy micro-batch: no rows of the batch
            return self
        x_BT = x_BT.detach()
        if x_BT.device.type == "cuda":
            host = torch.empty(x_BT.shape, dtype=x_BT.dtype, pin_memory=True)
            host.copy_(x_BT, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()  # on the current stream, after the copy
        else:
            host = x_BT.cpu()
        self._parts.append((host, mb))
        return self

    def rows(self) -> dict[int, Tensor]:
        """{batch row: its [R_b] slice}, views of one tensor per micro-batch (`Ragged` pickles them as one)."""
        if self._done is not None:
            self._done.synchronize()
        out: dict[int, Tensor] = {}
        for x_BT, mb in self._parts:
            valid = torch.arange(x_BT.size(1))[None, :] < mb.response_lens[:, None]
            out.update(zip(mb.index, torch.split(x_BT[valid], mb.response_lens.tolist()), strict=True))
        return out


def forward_rows(
    model: nn.Module,
    batch: TrainBatch,
    plan: list[list[int] | None],
    device: torch.device,
    what: str = "logp",
    pack: str = "auto",
) -> list[Tensor]:
    """Forward-only pass of every row of `batch`: per-sample response log-probs (`what="logp"`), entropy
    (`"entropy"`) or critic values (`"values"`), [N][R_i] on cpu. `plan` lists the micro-batches (row
    indices; None = a one-token dummy that keeps FSDP ranks in lockstep). The trainers, the critic, the
    reference and ActorFwd all run their forward-only passes through here."""
    if what not in ("logp", "entropy", "values"):
        raise ValueError(f"forward_rows: unknown output {what!r}; use logp, entropy or values")
    out: list[Tensor] = [torch.empty(0)] * len(batch)
    pending = RowsToHost()
    with torch.no_grad():
        for idx in plan:
            mb = micro_batch(model, batch, idx, device)
            if what == "values":
                result = value_forward(model, mb)
            else:
                logp, ent = policy_forward(model, mb, with_entropy=what == "entropy", pack=pack)
                result = ent if what == "entropy" else logp
            pending.add(result, mb)
    for i, row in pending.rows().items():
        out[i] = row
    return Ragged(out)
