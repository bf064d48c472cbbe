"""The model runner: a Hugging Face causal LM on one device, its tokenizer (optional), batched prefill
and decode over a `PaddedKVCache`, and in-place weight loading with a weight version.

Only the engine thread calls `prefill`, `decode` and `load_weights`, so no lock guards the model.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from relax.backends.inference.embedded.kv_cache import PaddedKVCache

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
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self._params = dict(self.model.state_dict(keep_vars=True))  # tied weights appear under each name
        text_cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.max_context_len = int(getattr(text_cfg, "max_position_embeddings", 0) or 32768)
        self.vocab_size = int(text_cfg.vocab_size)
        self.eos_token_ids = self._eos_ids()
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
    def _forward(self, ids_BT: Tensor, mask_BL: Tensor, pos_BT: Tensor, cache: PaddedKVCache | None):
        hf_cache = cache.to_hf() if cache is not None else DynamicCache()
        out = self.model(
            input_ids=ids_BT,
            attention_mask=mask_BL,
            position_ids=pos_BT,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: hf_cache},
        )
        return PaddedKVCache.from_hf(hf_cache, mask_BL), out.logits[:, -1, :]

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[PaddedKVCache, Tensor]:
        """Left-padded batched prefill; returns the prompts' cache and the last position's logits [B, V]."""
        L = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), L, dtype=torch.long)
        mask = torch.zeros(len(prompts), L, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, L - len(p) :] = 1
        pos = (mask.cumsum(dim=-1) - 1).clamp(min=0)
        return self._forward(ids.to(self.device), mask.to(self.device), pos.to(self.device), None)

    @torch.inference_mode()
    def decode(
        self, cache: PaddedKVCache, tokens: list[int], positions: list[int]
    ) -> tuple[PaddedKVCache, Tensor]:
        """One step for the whole batch: token b at position b; returns the grown cache and logits [B, V]."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device).unsqueeze(1)
        mask = torch.cat([cache.mask_BL, cache.mask_BL.new_ones(cache.batch_size, 1)], dim=1)
        return self._forward(ids, mask, pos, cache)

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
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return len(items)
