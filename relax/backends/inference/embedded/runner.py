"""The model runner: a Hugging Face causal LM on one device, its tokenizer (optional), batched prefill
and decode over a `SlotKVCache`, and in-place weight loading with a weight version.

The runner calls the model's decoder body and its `lm_head` itself (logits only where a token is
sampled) and hands the decoder a ready 4-D mask, so the model builds no mask and no cache of its own.
Llama-style models (Qwen2, Qwen3, Llama) run through `LeanDecoder` over the same weights.

Only the engine thread calls `prefill`, `decode` and `load_weights`, so no lock guards the model.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.backends.inference.embedded.kv_cache import SlotKVCache
from relax.backends.inference.embedded.lean_decoder import LeanDecoder

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_dtype(name: str | torch.dtype) -> torch.dtype | str:
    if isinstance(name, torch.dtype) or name == "auto":
        return name
    name = name.removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def load_tokenizer(path: str):  # -> PreTrainedTokenizerBase | None
    """The folder's tokenizer, or None when it has none (token-id requests do not need one)."""
    if not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a broken tokenizer must not stop a token-id engine
        logger.warning("could not load the tokenizer of %s (%s); text features are off", path, e)
        return None


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "auto",
        attn_implementation: str | None = "sdpa",
        weight_version: str = "0",
        use_lean: bool = True,
    ) -> None:
        self.model_path = str(model_path)
        self.device = torch.device(device)
        kwargs = {"dtype": resolve_dtype(dtype)}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, **kwargs).to(self.device).eval()
        self.dtype = next(self.model.parameters()).dtype
        self.config = self.model.config
        self.tokenizer = load_tokenizer(self.model_path)
        self.weight_version = str(weight_version)
        self.decoder = self.model.get_decoder()  # the transformer body; the engine applies lm_head itself
        self.lm_head = self.model.get_output_embeddings()
        self.lean = LeanDecoder(self.model) if use_lean and LeanDecoder.supports(self.model) else None
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self._params = dict(self.model.state_dict(keep_vars=True))  # tied weights appear under each name
        text_cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.max_context_len = int(getattr(text_cfg, "max_position_embeddings", 0) or 32768)
        self.vocab_size = int(text_cfg.vocab_size)
        self.eos_token_ids = self._eos_ids()
        heads = int(text_cfg.num_attention_heads)
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads
        self.cache = SlotKVCache(
            int(text_cfg.num_hidden_layers),
            int(getattr(text_cfg, "num_key_value_heads", None) or heads),
            int(head_dim),
            self.dtype,
            self.device,
        )
        layer_types = set(getattr(text_cfg, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise ValueError(
                f"{model_path}: layer types {sorted(layer_types)} are not supported (full attention only)"
            )
        logger.info(
            "loaded %s on %s (%s), context %d, tokenizer %s",
            self.model_path,
            self.device,
            self.dtype,
            self.max_context_len,
            "yes" if self.tokenizer is not None else "no",
        )

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen_cfg = getattr(self.model, "generation_config", None)
        for v in (getattr(gen_cfg, "eos_token_id", None), getattr(self.config, "eos_token_id", None)):
            ids.update([v] if isinstance(v, int) else (v or []))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # -- forward passes ----------------------------------------------------------------------------
    def _mask(self, allowed: Tensor) -> Tensor:
        """Additive attention mask [N, 1, Q, K] from a boolean one [N, Q, K] (works for sdpa and eager)."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min).unsqueeze(1)

    def _hidden(self, ids: Tensor, mask: Tensor, pos: Tensor, cache: SlotKVCache) -> Tensor:
        if self.lean is not None:
            return self.lean(ids, mask, pos, cache)
        out = self.decoder(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{self._cache_kwarg: cache}
        )
        return out.last_hidden_state

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> Tensor:
        """Right-padded batched prefill of prompt u into cache slot slots[u]; returns the logits of each
        prompt's last token [U, V]."""
        T = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), T, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        lens_U = torch.tensor([len(p) for p in prompts], device=self.device)
        col_T = torch.arange(T, device=self.device)
        allowed = (col_T[None, :] <= col_T[:, None])[None] & (col_T[None, None, :] < lens_U[:, None, None])
        pos = col_T.unsqueeze(0).expand(len(prompts), T)
        rows = torch.tensor(slots, device=self.device)
        h = self._hidden(ids.to(self.device), self._mask(allowed), pos, self.cache.for_prefill(rows))
        last_UH = h[torch.arange(len(prompts), device=self.device), lens_U - 1]
        return self.lm_head(last_UH)

    @torch.inference_mode()
    def decode(self, tokens_B: Tensor, pos_B: Tensor, length: int) -> Tensor:
        """One step for rows 0..B-1: token b at position pos_B[b], attending over `length` columns of the
        cache (> max(pos_B)); returns the logits [B, V]."""
        col_L = torch.arange(length, device=self.device)
        allowed = (col_L[None, :] <= pos_B[:, None]).unsqueeze(1)  # [B, 1, L]
        cache = self.cache.for_decode(pos_B, length)
        h = self._hidden(tokens_B.unsqueeze(1), self._mask(allowed), pos_B.unsqueeze(1), cache)
        return self.lm_head(h[:, 0])

    # -- weights -----------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(
        self, named_tensors: Iterable[tuple[str, Tensor]], weight_version: str | None = None
    ) -> int:
        """Copy tensors into the parameters of the same (Hugging Face) names; returns how many were set.

        Every name is checked before anything is copied, so a bad update leaves the model unchanged.
        """
        items = list(named_tensors)
        for name, tensor in items:
            if name not in self._params:
                known = ", ".join(list(self._params)[:4])
                raise KeyError(
                    f"unknown weight {name!r} (names are Hugging Face state_dict keys, e.g. {known})"
                )
            if tuple(tensor.shape) != tuple(self._params[name].shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, the model's is {tuple(self._params[name].shape)}"
                )
        for name, tensor in items:
            self._params[name].data.copy_(tensor)
        if self.lean is not None:
            self.lean.refresh()
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return len(items)
