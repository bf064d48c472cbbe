"""Log-probs and entropy of target tokens straight from hidden states and the lm-head weight, a chunk of
tokens at a time: the [N, V] logits never exist in full.

For hidden state :math:`h_n` and lm-head weight :math:`W` (tokens n = 1..N, vocabulary V), with
:math:`z_n = W h_n` and :math:`\\mathrm{lse}_n = \\log \\sum_v e^{z_{n,v}}`,

.. math::

    \\log p_n(y_n) = z_{n,y_n} - \\mathrm{lse}_n, \\qquad
    H_n = -\\sum_v p_{n,v} \\log p_{n,v}.

Backward, with upstream gradients :math:`g_n` (log-prob) and :math:`e_n` (entropy):

.. math::

    \\frac{\\partial L}{\\partial z_{n,v}} = g_n (\\mathbb{1}[v = y_n] - p_{n,v})
        - e_n\\, p_{n,v} (\\log p_{n,v} + H_n),

then :math:`\\partial L/\\partial h_n = W^\\top \\partial L/\\partial z_n` and
:math:`\\partial L/\\partial W = \\sum_n \\partial L/\\partial z_n\\, h_n^\\top`.

`token_logprobs` runs the lm-head matmul in the weight's dtype (bf16 under mixed precision) and the
softmax maths in fp32, one chunk of `chunk_tokens` tokens at a time; backward recomputes each chunk's
logits (one extra matmul) instead of keeping them, so memory is O(chunk x V), not O(N x V). The entropy
term of backward runs only when the entropy reached the loss (its gradient is not None), so a loss
without an entropy bonus pays only a cheap no-grad read of each chunk for the logged value. On CUDA the
per-chunk softmax maths are `torch.compile`d into a few fused kernels (one pass over the logits instead
of eight); on CPU they run eagerly. The same idea as Liger-Kernel's fused linear cross-entropy, written
here for log-probs + entropy with upstream gradients that arrive only in backward.

Media tokens that a multimodal model must never emit (`banned`) get the logit `BANNED_LOGIT`, as in
`relax.models.multimodal_model.mask_media_logits`, and no gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from relax.models.multimodal_model import BANNED_LOGIT, inner_model

logger = logging.getLogger(__name__)

CHUNK_TOKENS = 4096  # tokens per chunk: fp32 [4096, 151936] logits are 2.5 GB


# -- per-chunk maths (pure functions of tensors; compiled on CUDA) -----------------------------------
def _masked(z_CV: Tensor, banned: Tensor | None) -> Tensor:
    z = z_CV.float()
    return z if banned is None else z.index_fill(-1, banned, BANNED_LOGIT)


def _chunk_stats(z_CV: Tensor, targets_C: Tensor, banned: Tensor | None, with_entropy: bool):
    """(lse, log p(target), entropy or None) of one chunk of logits [C, V], all fp32 [C]."""
    z = _masked(z_CV, banned)
    lse_C = torch.logsumexp(z, dim=-1)
    logp_C = z.gather(-1, targets_C[:, None]).squeeze(-1) - lse_C
    if not with_entropy:
        return lse_C, logp_C, None
    logp_CV = z - lse_C[:, None]
    ent_C = -(torch.exp(logp_CV) * logp_CV).sum(-1)  # not lse - sum p z: that cancels when H << lse
    return lse_C, logp_C, ent_C


def _chunk_grad(
    z_CV: Tensor,
    targets_C: Tensor,
    lse_C: Tensor,
    ent_C: Tensor | None,
    g_logp_C: Tensor,
    g_ent_C: Tensor | None,
    banned: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """dL/dz [C, V] in `out_dtype` (see the module docstring)."""
    logp_CV = _masked(z_CV, banned) - lse_C[:, None]
    p_CV = torch.exp(logp_CV)
    coef_CV = -g_logp_C[:, None]
    if g_ent_C is not None:
        coef_CV = coef_CV - g_ent_C[:, None] * (logp_CV + ent_C[:, None])
    vocab_V = torch.arange(z_CV.size(-1), device=z_CV.device)
    onehot = vocab_V[None, :] == targets_C[:, None]  # [C, V], fused away when compiled
    grad_CV = p_CV * coef_CV + torch.where(onehot, g_logp_C[:, None], 0.0)
    if banned is not None:  # the banned logits are constants: no gradient reaches z
        grad_CV = grad_CV.index_fill(-1, banned, 0.0)
    return grad_CV.to(out_dtype)


_COMPILED: dict[str, Callable[..., Any]] = {}


def _kernel(name: str, device: torch.device) -> Callable[..., Any]:
    fn = {"stats": _chunk_stats, "grad": _chunk_grad}[name]
    if device.type != "cuda":
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=None)
    return _COMPILED[name]


# -- the autograd function ---------------------------------------------------------------------------
class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, banned, with_entropy, chunk):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # an unused entropy arrives in backward as None
        N = hidden_NH.size(0)
        f32 = dict(dtype=torch.float32, device=hidden_NH.device)
        lse_N, logp_N = torch.empty(N, **f32), torch.empty(N, **f32)
        ent_N = torch.empty(N, **f32) if with_entropy else torch.zeros(0, **f32)
        stats = _kernel("stats", hidden_NH.device)
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            z_CV = hidden_NH[s:e] @ weight_VH.T  # [C, V] in the compute dtype
            lse_N[s:e], logp_N[s:e], ent = stats(z_CV, targets_N[s:e], banned, with_entropy)
            if with_entropy:
                ent_N[s:e] = ent
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, lse_N, ent_N, banned)
        ctx.with_entropy, ctx.chunk = with_entropy, chunk
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N):  # type: ignore[override]
        hidden_NH, weight_VH, targets_N, lse_N, ent_N, banned = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not ctx.with_entropy:
            g_ent_N = None
        if (g_logp_N is None and g_ent_N is None) or not (need_h or need_w):
            return None, None, None, None, None, None
        N, chunk = hidden_NH.size(0), ctx.chunk
        if g_logp_N is None:
            g_logp_N = torch.zeros_like(lse_N)
        grad_h = torch.empty_like(hidden_NH) if need_h else None
        # fp32 accumulator across chunks when the weight is low precision; in place otherwise
        grad_w = (
            torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if need_w else None
        )
        grad = _kernel("grad", hidden_NH.device)
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            h_CH = hidden_NH[s:e]
            z_CV = h_CH @ weight_VH.T
            g_ent = None if g_ent_N is None else g_ent_N[s:e]
            gz_CV = grad(
                z_CV,
                targets_N[s:e],
                lse_N[s:e],
                ent_N[s:e] if g_ent is not None else None,
                g_logp_N[s:e].float(),
                None if g_ent is None else g_ent.float(),
                banned,
                weight_VH.dtype,
            )
            del z_CV
            if grad_h is not None:
                torch.mm(gz_CV, weight_VH, out=grad_h[s:e])
            if grad_w is not None:
                if weight_VH.dtype == torch.float32:
                    grad_w.addmm_(gz_CV.T, h_CH)
                else:
                    grad_w += gz_CV.T @ h_CH
        return grad_h, None if grad_w is None else grad_w.to(weight_VH.dtype), None, None, None, None


def token_logprobs(
    hidden_NH: Tensor,
    weight_VH: Tensor,
    targets_N: Tensor,
    *,
    with_entropy: bool = True,
    banned: Sequence[int] = (),
    chunk_tokens: int = CHUNK_TOKENS,
) -> tuple[Tensor, Tensor | None]:
    """fp32 log p(target) [N] and (if `with_entropy`) entropy [N] of `softmax(hidden @ weight.T)`,
    differentiable in `hidden` and `weight`, without building the [N, V] logits."""
    banned_t = torch.tensor(sorted(banned), dtype=torch.long, device=hidden_NH.device) if banned else None
    logp_N, ent_N = _ChunkedLogProbs.apply(
        hidden_NH.to(weight_VH.dtype), weight_VH, targets_N, banned_t, with_entropy, max(1, int(chunk_tokens))
    )
    return logp_N, ent_N if with_entropy else None


# -- ragged response tokens <-> padded [B, T] ------------------------------------------------------
def ragged_index(lengths_B: Tensor) -> tuple[Tensor, Tensor]:
    """(row b, column t) of every t < lengths[b], each [N] with N = sum(lengths), row-major (cpu)."""
    lengths_B = lengths_B.long().cpu()
    rows_N = torch.repeat_interleave(torch.arange(len(lengths_B)), lengths_B)
    starts_B = torch.cumsum(lengths_B, 0) - lengths_B
    cols_N = torch.arange(int(lengths_B.sum())) - starts_B[rows_N]
    return rows_N, cols_N


def scatter_padded(x_N: Tensor, rows_N: Tensor, cols_N: Tensor, shape: tuple[int, int]) -> Tensor:
    """[B, T] zeros with x_N at (rows_N, cols_N); differentiable in x_N."""
    return x_N.new_zeros(shape).index_put((rows_N, cols_N), x_N)


# -- the model side: decoder hidden states and the head weight ---------------------------------------
def _causal_lm(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def plain_head(model: nn.Module) -> nn.Linear | None:
    """The lm head when logits are exactly `hidden @ head.weight.T` (a bias-free Linear, no logit
    scaling or soft-capping, not wrapped by LoRA); None means: use the model's own logits."""
    lm = _causal_lm(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    cfg = getattr(lm, "config", None)
    scaled = any(getattr(cfg, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale"))
    if type(head) is not nn.Linear or head.bias is not None or scaled or not hasattr(lm, "model"):
        return None
    return head


def decoder_hidden(model: nn.Module, **inputs: Any) -> Tensor:
    """Last hidden states [B, L, H] of the model's decoder body (`model.model`, after the final norm).

    The call goes through the model itself, not the body alone, so that FSDP2's hooks on the root
    module (gather its parameters, reduce their gradients) run; the body's output is caught by a
    forward hook, and `logits_to_keep=1` makes the head's own work negligible ([B, 1, V])."""
    caught: dict[str, Tensor] = {}

    def hook(_module: nn.Module, _args: Any, output: Any) -> None:
        caught["h"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handle = inner_model(_causal_lm(model)).register_forward_hook(hook)
    try:
        model(**inputs, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    return caught["h"]
