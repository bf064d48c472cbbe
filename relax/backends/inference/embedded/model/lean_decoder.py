"""A lean forward for Llama-style decoders (Qwen2, Qwen3, Llama, and the text decoders of Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and the Qwen2.5-Omni thinker), over the Hugging Face model's own weights: the same
maths as `transformers` with far fewer Python calls per step.

Per layer it runs RMSNorm, one fused q/k/v projection, (Qwen3: per-head q/k RMSNorm), rotary embedding
of q and k together, the cache write, SDPA, the output projection (accumulated into the residual), RMSNorm,
one fused gate/up projection and the down projection (accumulated into the residual): about 15 kernels,
which is what a decode step's time is made of at small batch. In bf16 the rounding differs slightly
from `transformers` (RMSNorm scales before rounding; residual adds happen in the GEMM's float32). The fused
weights are copies: `refresh()` rebuilds them after the model's weights change (the runner calls it).
For one query token the query heads are grouped under their key/value head ([N, H_kv, rep, D]), so
grouped-query attention needs no repeated keys. Other architectures use the `transformers` forward.

On CUDA in bf16 / fp16 (`triton_decode`, set where Triton runs; False falls back to the torch ops), a decode
step's attention is one Triton kernel (`attention_step.py`: the input RMSNorm's row scale, the q/k/v bias,
rotary embedding, cache write and attention by per-row lengths, so the step needs no mask) and the MLP's
silu(gate) * up with the post-attention RMSNorm's row scale another (`silu_mul.py`, in a prefill too).
For that the two RMSNorm weights are folded into the fused q/k/v and gate/up weights (`fold_norms`, on
where the Triton kernels run; not the q/k/v fold for Qwen3, whose per-head q/k norm follows the
projection): RMSNorm(x) W^T = rsqrt(mean(x^2) + eps) * (x (W * g)^T), the row scale applied after the
product. Both shortened the decode step on an H200 (docs/measurements.md).

The rotary cos / sin come from a table of the model's own rotary embedding over positions 0..P-1: one
lookup instead of about a dozen ops per step (on the CPU a small step's time is mostly per-op overhead;
on a GPU those ops are ~10 kernels of each captured step). The CPU's table grows by
doubling; the CUDA table is built once over the context (at most `MAX_TABLE` positions), since captured
graphs hold its address. Not for dynamic rotary types, whose frequencies depend on the sequence length.

Multimodal models rotate by mrope: a position is three components (time, height, width), each owning
sections of the rotary frequencies (contiguous sections in Qwen2-VL / Qwen2.5-VL / Omni, interleaved in
Qwen3-VL). A text token's three components are equal, and then every frequency sees the same position:
mrope is exactly 1-D rotary at that position. The engine prefills a prompt with media through the
`transformers` forward at its mrope positions (`ModelRunner.prefill_multimodal`); every token after it is
text at position column + rope delta, so its decode step is this decoder's plain step at that position.
The table is built from the model's own mrope rotary, handed the position as three equal components
([3, N, T]: what it takes in transformers 5.17; later versions also take [N, T]).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from relax.backends.inference.embedded.model import decode_attention, packed_prefill
from relax.backends.inference.embedded.model.attention_step import attention_step
from relax.backends.inference.embedded.model.packed_prefill import PackedPrefill
from relax.backends.inference.embedded.model.prefill_rope import rope_prefill
from relax.backends.inference.embedded.model.silu_mul import silu_mul

logger = logging.getLogger(__name__)

SUPPORTED = {"qwen2", "qwen3", "llama"}
# multimodal models whose text decoder is Qwen2- or Qwen3-style under mrope (module docstring); not the
# Qwen3-Omni thinker, whose decoder layers are mixtures of experts
MROPE_SUPPORTED = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni_thinker"}
DYNAMIC_ROPE = ("dynamic", "longrope")  # rotary types whose frequencies change with the sequence length
MAX_TABLE = 1 << 17  # positions of a CUDA rotary table (head size 128: 64 MiB in bf16); later ones computed


def _rms(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm in one kernel (float32 inside, one rounding; `transformers` rounds before the scale)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _fold(weight: Tensor, norm_weight: Tensor) -> Tensor:
    """weight [out, in] with an RMSNorm weight [in] folded in (each input column scaled), rounded once."""
    return (weight.float() * norm_weight.float()).to(weight.dtype)


def _rotary(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin in three kernels: rotate_half(x) * sin = swap_halves(x) * sin_signed,
    sin_signed = [-sin_a, sin_b] for sin = [sin_a, sin_b]."""
    D = x.shape[-1]
    swapped = x.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin_signed)


def _columns(mask: Tensor | PackedPrefill) -> int:
    """The most cache columns a row attends under `mask`."""
    return mask.columns if isinstance(mask, PackedPrefill) else mask.shape[-1]


def _attend_one(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention of one query token per row, its query heads grouped under their key/value head:
    q [N, Hk, rep, D], k and v [N, Hk, K, D], additive mask [N, 1, 1, K]. On the CPU it is two batched
    matmuls and a softmax: at a few query heads per row the fused SDPA kernel's setup per (row, head)
    costs more than the maths."""
    if q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(mask)  # [N, Hk, rep, K]
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)


class LeanDecoder:
    @staticmethod
    def supports(model: Any) -> bool:
        if getattr(model.config, "model_type", None) not in SUPPORTED | MROPE_SUPPORTED:
            return False
        cfg = model.config.get_text_config()  # a multimodal model's text decoder config; else itself
        if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
            return False  # Llama's optional MLP biases: the fused MLP has none
        layers = getattr(model.get_decoder(), "layers", None)
        return bool(layers) and all(
            hasattr(layer.self_attn, "q_proj") and hasattr(layer.mlp, "gate_proj") for layer in layers
        )

    def __init__(self, model: Any, fold_norms: bool | None = None) -> None:
        """`fold_norms`: fold the RMSNorm weights into the projections (None: where `triton_decode`)."""
        self.body = model.get_decoder()
        self.mrope = model.config.model_type in MROPE_SUPPORTED  # the rotary takes [3, N, T] positions
        cfg = model.config.get_text_config()
        self.eps = float(cfg.rms_norm_eps)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.layers: list[dict[str, Any]] = []
        # decode attention: the Triton kernels where they run (`attention_step.py`), else SDPA with a mask
        self.triton_decode = decode_attention.available(
            self.body.embed_tokens.weight.device, self.body.embed_tokens.weight.dtype, self.head_dim
        )
        self.fold_norms = self.triton_decode if fold_norms is None else fold_norms
        self.refresh()
        rope_type = getattr(self.body.rotary_emb, "rope_type", "default")
        self._rope_static = isinstance(rope_type, str) and not any(t in rope_type for t in DYNAMIC_ROPE)
        self._rope_table: Tensor | None = None  # [P, 2, D]: cos and sin_signed at positions 0..P-1

    @torch.no_grad()
    def refresh(self) -> None:
        """(Re)build the fused weights from the model's current parameters, in place when they exist
        (captured CUDA graphs hold their addresses); with `fold_norms`, the RMSNorm weights folded in."""
        old, self.layers = self.layers, []
        for layer in self.body.layers:
            a, m = layer.self_attn, layer.mlp
            biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
            ln1, ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            qk_norm = self._qk_norm(a)
            fold1 = self.fold_norms and qk_norm is None  # Qwen3's q/k norm needs the scaled projection
            qkv_w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            gate_up_w = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            self.layers.append(
                {
                    "ln1": ln1,
                    "ln2": ln2,
                    "fold1": fold1,
                    "fold2": self.fold_norms,
                    "qkv_w": _fold(qkv_w, ln1) if fold1 else qkv_w,
                    "qkv_b": torch.cat(biases) if all(b is not None for b in biases) else None,
                    "qk_norm": qk_norm,
                    "o_w": a.o_proj.weight,
                    "o_b": a.o_proj.bias,
                    "gate_up_w": _fold(gate_up_w, ln2) if self.fold_norms else gate_up_w,
                    "down_w": m.down_proj.weight,
                    "scaling": float(getattr(a, "scaling", self.head_dim**-0.5)),
                }
            )
        for before, now in zip(old, self.layers, strict=False):
            for key in ("qkv_w", "qkv_b", "qk_norm", "gate_up_w"):
                if before[key] is not None:
                    now[key] = before[key].copy_(now[key])

    def _qk_norm(self, attn: Any) -> Tensor | None:
        """Qwen3's per-head q and k RMSNorm weights as one [Hq + Hk, D] scale (None: no q/k norm)."""
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is None:
            return None
        D = self.head_dim
        return torch.cat([q_norm.weight.expand(self.heads, D), k_norm.weight.expand(self.kv_heads, D)])

    def _cos_sin(self, h: Tensor, pos_NT: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """cos and sin_signed [N, T, 1, D] (broadcast over the heads of q and k) at positions `pos_NT`,
        all below `length`."""
        D = self.head_dim
        table = self._table(h, length) if self._rope_static else None
        if table is not None:
            cs = table.index_select(0, pos_NT.flatten()).view(*pos_NT.shape, 2, 1, D)
            return cs.select(2, 0), cs.select(2, 1)
        cos, sin_signed = self._rope(h, pos_NT)
        return cos.unsqueeze(2), sin_signed.unsqueeze(2)

    def _table(self, h: Tensor, length: int) -> Tensor | None:
        """The rotary table covering positions below `length`, or None where it cannot serve. On the CPU
        it grows by doubling. On CUDA it is built once, outside any graph capture, over the model's whole
        context: captured graphs hold its address, so it is never replaced (a longer position or another
        dtype computes cos / sin directly)."""
        table = self._rope_table
        if table is not None and table.shape[0] >= length and table.dtype == h.dtype:
            return table
        if h.device.type == "cpu":
            P = max(length, 2 * table.shape[0] if table is not None else 256)
        elif table is None and not torch.cuda.is_current_stream_capturing():
            context = int(getattr(self.body.config, "max_position_embeddings", 0) or 0)
            P = max(length, min(context, MAX_TABLE))
        else:
            return None
        positions = torch.arange(P, device=h.device)[None]
        self._rope_table = torch.stack(self._rope(h, positions), dim=2)[0]
        return self._rope_table if self._rope_table.shape[0] >= length else None

    def _rope(self, h: Tensor, pos_NT: Tensor) -> tuple[Tensor, Tensor]:
        """The model's rotary cos and sin_signed (see `_rotary`) at `pos_NT`, [N, T, D] each; an mrope
        rotary at three equal components (module docstring)."""
        D = self.head_dim
        cos, sin = self.body.rotary_emb(h, pos_NT.expand(3, *pos_NT.shape) if self.mrope else pos_NT)
        return cos, torch.cat([-sin[..., : D // 2], sin[..., D // 2 :]], dim=-1)

    def __call__(
        self,
        ids_NT: Tensor,
        mask: Tensor | PackedPrefill | None,
        pos_NT: Tensor,
        cache: Any,
        lengths_N: Tensor | None = None,
        rope_len: int = 0,
    ) -> Tensor:
        """Hidden states [N, T, hidden] after the final norm. A decode step (T = 1) attends over each row's
        first `lengths_N` cache columns with the Triton kernel when `triton_decode`, else with the additive
        mask [N, 1, 1, K]. The rotary positions `pos_NT` are below max(`rope_len`, the columns attended):
        `rope_len` covers rows whose rotary position runs ahead of their cache column (mrope).

        `mask` is None for a prefill of right-padded prompts: plain causal attention is then exact on every
        real token (its keys all precede it; padding only ever follows), lets SDPA use the flash kernel (an
        explicit mask with grouped-query heads fell back to the math kernel, half of a prefill's GPU time),
        and the padding's outputs and cache columns are never read (a decode step writes a column before any
        row attends to it). A `PackedPrefill` is a prefill past cached prefixes (`packed_prefill.py`)."""
        N, T = ids_NT.shape
        Hq, Hk, D = self.heads, self.kv_heads, self.head_dim
        h = F.embedding(ids_NT, self.body.embed_tokens.weight)
        length = max(rope_len, T if mask is None else _columns(mask))
        cos, sin_signed = self._cos_sin(h, pos_NT, length)  # [N, T, 1, D]
        qkv_split = [(Hq + Hk) * D, Hk * D]
        triton_step = T == 1 and lengths_N is not None
        for i, w in enumerate(self.layers):
            qkv = self._qkv(h, w, scaled=not triton_step)
            qk, v = qkv.split(qkv_split, dim=-1)
            qk = qk.unflatten(-1, (Hq + Hk, D))  # q and k heads side by side
            v = v.unflatten(-1, (Hk, D))
            if w["qk_norm"] is not None:
                qk = _rms(qk, None, self.eps) * w["qk_norm"]
            if triton_step:
                o = self._triton_decode_attention(
                    qk[:, 0], v[:, 0], cos, sin_signed, cache, i, lengths_N, h[:, 0]
                )
            else:
                o = self._torch_attention(qk, v, cos, sin_signed, mask, cache, i)
            h = self._mlp_block(h, o, w, fused=self.triton_decode)
        return _rms(h, self.body.norm.weight, self.eps)

    def _qkv(self, h: Tensor, w: dict[str, Any], scaled: bool) -> Tensor:
        """The fused q/k/v projection of the layer input h. With the input norm's weight folded in,
        `scaled` normalises h first (RMSNorm without a weight: the same product) and adds the bias;
        otherwise the product runs on h itself and the Triton step applies the row scale and bias."""
        if not w["fold1"]:
            return F.linear(_rms(h, w["ln1"], self.eps), w["qkv_w"], w["qkv_b"])
        if scaled:
            return F.linear(_rms(h, None, self.eps), w["qkv_w"], w["qkv_b"])
        return F.linear(h, w["qkv_w"])

    def _torch_attention(
        self,
        qk: Tensor,
        v: Tensor,
        cos: Tensor,
        sin_signed: Tensor,
        mask: Tensor | PackedPrefill | None,
        cache: Any,
        layer: int,
    ) -> Tensor:
        """Rotary embedding, cache write and attention in torch ops. qk [N, T, Hq + Hk, D], v [N, T, Hk, D];
        returns [N * T, Hq * D]."""
        N, T = qk.shape[:2]
        Hq, Hk, D = self.heads, self.kv_heads, self.head_dim
        scale = self.layers[layer]["scaling"]
        if mask is None and self.triton_decode:  # a prefill on CUDA: rotary and cache write in one kernel
            k_buf, v_buf, table, rows_N = cache.prefill_buffers(layer)
            rope_prefill(qk, v, cos[:, :, 0], sin_signed[:, :, 0], k_buf, v_buf, rows_N, table)  # qk in place
            q, k = qk.split([Hq, Hk], dim=2)
            k_all, v_all = k.transpose(1, 2), v.transpose(1, 2)
        else:
            qk = _rotary(qk, cos, sin_signed)  # [N, T, Hq + Hk, D], contiguous
            q, k = qk.split([Hq, Hk], dim=2)
            k_all, v_all = cache.update(k.transpose(1, 2), v.transpose(1, 2), layer)  # [N, Hk, K, D]
        if isinstance(mask, PackedPrefill):  # past cached prefixes, as one variable-length flash call
            return packed_prefill.attend(q, k_all, v_all, mask, scale)
        if T == 1 and mask is not None:  # decode: query heads grouped under their kv head (a view)
            return _attend_one(q.reshape(N, Hk, Hq // Hk, D), k_all, v_all, mask, scale).reshape(N, Hq * D)
        # a prefill of right-padded prompts: causal when there is no mask (see `__call__`)
        gqa = Hq != Hk
        if mask is not None and gqa and q.device.type == "cuda":
            # a prefill past a cached prefix (`ModelRunner.prefill_after`): with a mask, grouped heads
            # would take the math kernel; repeated key/value heads take the memory-efficient one
            k_all = k_all.repeat_interleave(Hq // Hk, dim=1)
            v_all = v_all.repeat_interleave(Hq // Hk, dim=1)
            gqa = False
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k_all,
            v_all,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=gqa,
        )
        return o.transpose(1, 2).reshape(N * T, Hq * D)

    def _triton_decode_attention(
        self,
        qk: Tensor,
        v: Tensor,
        cos: Tensor,
        sin_signed: Tensor,
        cache: Any,
        layer: int,
        lengths_N: Tensor,
        x: Tensor,
    ) -> Tensor:
        """A decode step's attention in one Triton kernel (`attention_step.py`): the input norm's row
        scale of x [N, hidden] and the bias where the norm is folded in, rotary embedding, the cache write
        and attention over each row's `lengths_N` columns. qk [N, Hq + Hk, D], v [N, Hk, D]; returns
        [N, Hq * D]."""
        w = self.layers[layer]
        k_buf, v_buf, table, rows_N, _, L = cache.decode_buffers(layer)
        fold = w["fold1"]
        return attention_step(
            qk, v, cos[:, 0, 0], sin_signed[:, 0, 0], k_buf, v_buf, rows_N, lengths_N, L, w["scaling"],
            x=x if fold else None, bias=w["qkv_b"] if fold else None, eps=self.eps, table=table,
        )  # fmt: skip

    def _mlp_block(self, h: Tensor, o: Tensor, w: dict[str, Any], fused: bool = False) -> Tensor:
        """The rest of a layer after attention: output projection into the residual, RMSNorm, gated MLP
        into the residual. h [N, T, H], o [N * T, Hq * D]; `fused`: silu(gate) * up in one Triton kernel."""
        N, T, H = h.shape
        h = h.view(N * T, H)
        if w["o_b"] is None:
            h.addmm_(o, w["o_w"].t())  # the residual add is the GEMM's accumulate
        else:
            h = h + F.linear(o, w["o_w"], w["o_b"])
        if fused and w["fold2"] and T == 1:  # a decode step: the norm's row scale inside the activation
            act = silu_mul(F.linear(h, w["gate_up_w"]), h, self.eps)
        else:  # a folded norm weight is in gate_up_w already
            x = _rms(h, None if w["fold2"] else w["ln2"], self.eps)
            gate_up = F.linear(x, w["gate_up_w"])
            if fused:
                act = silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate).mul_(up)
        h.addmm_(act, w["down_w"].t())
        return h.view(N, T, H)
