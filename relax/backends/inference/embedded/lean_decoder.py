"""A lean forward for Llama-style decoders (Qwen2, Qwen3, Llama), over the Hugging Face model's own
weights: the same maths as `transformers` with far fewer Python calls per step.

Per layer it runs RMSNorm, one fused q/k/v projection, (Qwen3: per-head q/k RMSNorm), rotary embedding,
the cache write, SDPA, the output projection, RMSNorm and one fused gate/up projection. The fused
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


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`transformers`' RMSNorm: normalise in float32, cast back, then scale."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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
        """(Re)build the fused weights from the model's current parameters."""
        self.layers = []
        for layer in self.body.layers:
            a, m = layer.self_attn, layer.mlp
            biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
            self.layers.append(
                {
                    "ln1": layer.input_layernorm.weight,
                    "ln2": layer.post_attention_layernorm.weight,
                    "qkv_w": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    "qkv_b": torch.cat(biases) if all(b is not None for b in biases) else None,
                    "q_norm": getattr(getattr(a, "q_norm", None), "weight", None),
                    "k_norm": getattr(getattr(a, "k_norm", None), "weight", None),
                    "o_w": a.o_proj.weight,
                    "o_b": a.o_proj.bias,
                    "gate_up_w": torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                    "down_w": m.down_proj.weight,
                    "scaling": float(getattr(a, "scaling", self.head_dim**-0.5)),
                }
            )

    def __call__(self, ids_NT: Tensor, mask: Tensor, pos_NT: Tensor, cache: Any) -> Tensor:
        """Hidden states [N, T, hidden] after the final norm; `mask` is additive [N, 1, T, K]."""
        N, T = ids_NT.shape
        Hq, Hk, D = self.heads, self.kv_heads, self.head_dim
        h = self.body.embed_tokens(ids_NT)
        cos, sin = self.body.rotary_emb(h, pos_NT)  # [N, T, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, w in enumerate(self.layers):
            x = _rms(h, w["ln1"], self.eps)
            q, k, v = F.linear(x, w["qkv_w"], w["qkv_b"]).split([Hq * D, Hk * D, Hk * D], dim=-1)
            q, k, v = q.view(N, T, Hq, D), k.view(N, T, Hk, D), v.view(N, T, Hk, D)
            if w["q_norm"] is not None:
                q, k = _rms(q, w["q_norm"], self.eps), _rms(k, w["k_norm"], self.eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [N, H, T, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_all, v_all = cache.update(k, v, i)
            if T == 1:  # group the query heads under their kv head: [N, Hk, rep, D]
                o = F.scaled_dot_product_attention(
                    q.reshape(N, Hk, Hq // Hk, D), k_all, v_all, attn_mask=mask, scale=w["scaling"]
                ).reshape(N, 1, Hq * D)
            else:
                o = (
                    F.scaled_dot_product_attention(
                        q, k_all, v_all, attn_mask=mask, scale=w["scaling"], enable_gqa=Hq != Hk
                    )
                    .transpose(1, 2)
                    .reshape(N, T, Hq * D)
                )
            h = h + F.linear(o, w["o_w"], w["o_b"])
            x = _rms(h, w["ln2"], self.eps)
            gate, up = F.linear(x, w["gate_up_w"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w["down_w"])
        return _rms(h, self.body.norm.weight, self.eps)
