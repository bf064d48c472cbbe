"""A lean forward for Llama-style decoders (Qwen2, Qwen3, Llama), over the Hugging Face model's own
weights: the same maths as `transformers` with far fewer Python calls per step.

Per layer it runs RMSNorm, one fused q/k/v projection, (Qwen3: per-head q/k RMSNorm), rotary embedding
of q and k together, the cache write, SDPA, the output projection (accumulated into the residual), RMSNorm,
one fused gate/up projection and the down projection (accumulated into the residual): about 15 kernels,
which is what a decode step's time is made of at small batch. In bf16 the rounding differs slightly
from `transformers` (RMSNorm scales before rounding; residual adds happen in the GEMM's float32). The fused
weights are copies: `refresh()` rebuilds them after the model's weights change (the runner calls it).
For one query token the query heads are grouped under their key/value head ([N, H_kv, rep, D]), so
grouped-query attention needs no repeated keys. Other architectures use the `transformers` forward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

SUPPORTED = {"qwen2", "qwen3", "llama"}


def _rms(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm in one kernel (float32 inside, one rounding; `transformers` rounds before the scale)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rotary(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin in three kernels: rotate_half(x) * sin = swap_halves(x) * sin_signed,
    sin_signed = [-sin_a, sin_b] for sin = [sin_a, sin_b]."""
    D = x.shape[-1]
    swapped = x.unflatten(-1, (2, D // 2)).flip(-2).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin_signed)


class LeanDecoder:
    @staticmethod
    def supports(model: Any) -> bool:
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED or getattr(cfg, "hidden_act", "silu") != "silu":
            return False
        layers = getattr(model.get_decoder(), "layers", None)
        return bool(layers) and all(hasattr(layer.self_attn, "q_proj") for layer in layers)

    def __init__(self, model: Any) -> None:
        self.body = model.get_decoder()
        cfg = model.config
        self.eps = float(cfg.rms_norm_eps)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.layers: list[dict[str, Any]] = []
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """(Re)build the fused weights from the model's current parameters, in place when they exist
        (captured CUDA graphs hold their addresses)."""
        old, self.layers = self.layers, []
        for layer in self.body.layers:
            a, m = layer.self_attn, layer.mlp
            biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
            self.layers.append(
                {
                    "ln1": layer.input_layernorm.weight,
                    "ln2": layer.post_attention_layernorm.weight,
                    "qkv_w": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    "qkv_b": torch.cat(biases) if all(b is not None for b in biases) else None,
                    "qk_norm": self._qk_norm(a),
                    "o_w": a.o_proj.weight,
                    "o_b": a.o_proj.bias,
                    "gate_up_w": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
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

    def __call__(self, ids_NT: Tensor, mask: Tensor, pos_NT: Tensor, cache: Any) -> Tensor:
        """Hidden states [N, T, hidden] after the final norm; `mask` is additive [N, 1, T, K]."""
        N, T = ids_NT.shape
        Hq, Hk, D = self.heads, self.kv_heads, self.head_dim
        h = self.body.embed_tokens(ids_NT)
        H = h.shape[-1]
        cos, sin = self.body.rotary_emb(h, pos_NT)  # [N, T, D]
        cos = cos.unsqueeze(2)  # [N, T, 1, D], over the heads of q and k at once
        sin_signed = torch.cat([-sin[..., : D // 2], sin[..., D // 2 :]], dim=-1).unsqueeze(2)
        for i, w in enumerate(self.layers):
            x = _rms(h, w["ln1"], self.eps)
            qkv = F.linear(x, w["qkv_w"], w["qkv_b"])  # [N, T, (Hq + 2 Hk) D]
            qk = qkv[..., : (Hq + Hk) * D].unflatten(-1, (Hq + Hk, D))  # q and k heads side by side
            v = qkv[..., (Hq + Hk) * D :].unflatten(-1, (Hk, D))
            if w["qk_norm"] is not None:
                qk = _rms(qk, None, self.eps) * w["qk_norm"]
            qk = _rotary(qk, cos, sin_signed)  # [N, T, Hq + Hk, D], contiguous
            q, k = qk[:, :, :Hq], qk[:, :, Hq:]
            k_all, v_all = cache.update(k.transpose(1, 2), v.transpose(1, 2), i)  # [N, Hk, K, D]
            if T == 1:  # group the query heads under their kv head: [N, Hk, rep, D] (a view)
                o = F.scaled_dot_product_attention(
                    q.reshape(N, Hk, Hq // Hk, D), k_all, v_all, attn_mask=mask, scale=w["scaling"]
                ).reshape(N * T, Hq * D)
            else:
                o = (
                    F.scaled_dot_product_attention(
                        q.transpose(1, 2),
                        k_all,
                        v_all,
                        attn_mask=mask,
                        scale=w["scaling"],
                        enable_gqa=Hq != Hk,
                    )
                    .transpose(1, 2)
                    .reshape(N * T, Hq * D)
                )
            h = h.view(N * T, H)
            if w["o_b"] is None:
                h.addmm_(o, w["o_w"].t())  # the residual add is the GEMM's accumulate
            else:
                h = h + F.linear(o, w["o_w"], w["o_b"])
            x = _rms(h, w["ln2"], self.eps)
            gate, up = F.linear(x, w["gate_up_w"]).chunk(2, dim=-1)
            h.addmm_(F.silu(gate).mul_(up), w["down_w"].t())
            h = h.view(N, T, H)
        return _rms(h, self.body.norm.weight, self.eps)
