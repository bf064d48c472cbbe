"""The model runner: a Hugging Face causal LM on one device, its tokenizer (optional), batched prefill
and decode over a `PagedKVCache`, and in-place weight loading with a weight version.

The runner calls the model's decoder body and its `lm_head` itself (logits only where a token is
sampled) and hands the decoder a ready 4-D mask, so the model builds no mask and no cache of its own.
Llama-style models (Qwen2, Qwen3, Llama) run through `LeanDecoder` over the same weights.

A multimodal model (Qwen-VL, Omni thinkers) prefills through the `transformers` forward: the model body
(vision/audio encoders, then the decoder) at the model's own mrope positions
(`relax.models.multimodal_model`), writing the cache through `PagedKVCache.update`; it returns each
prompt's rope delta. Every token after the prompt is text, at rotary position `cache column + delta` with
equal mrope components, where mrope is plain 1-D rotary: so the decode steps of a model whose text decoder
`LeanDecoder` supports (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, the Qwen2.5-Omni thinker) run through it and its
CUDA graphs like a text model's, each row's delta one more graph input. The Qwen3-Omni thinker (a mixture
of experts) decodes through the `transformers` forward.

On CUDA, attention runs on the flash / memory-efficient / math SDPA kernels, never cuDNN's: cuDNN builds
an execution plan for every new shape (milliseconds of host time per call, docs/measurements.md, and the
attended length grows every step). Decode steps of the lean decoder replay CUDA graphs (`cuda_graphs.py`).

Only the engine thread calls `prefill`, `decode` and `load_weights`, so no lock guards the model.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers import AutoTokenizer

from relax.backends.inference.embedded.model import packed_prefill
from relax.backends.inference.embedded.model.cuda_graphs import DecodeGraphs
from relax.backends.inference.embedded.model.lean_decoder import LeanDecoder
from relax.backends.inference.embedded.model.paged_kv_cache import PagedKVCache
from relax.engine_api.protocol import version_to_engine
from relax.models import multimodal_model as mmm
from relax.models.numerics import use_float32_reductions

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # no cuDNN
ROPE_MARGIN_STEP = 256  # the rope margin grows in these steps (each growth recaptures the decode graphs)


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
        cuda_graphs: bool = True,
    ) -> None:
        self.model_path = str(model_path)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            use_float32_reductions()  # the trainer's products, reduced alike (relax/models/numerics.py)
        kwargs = {"dtype": resolve_dtype(dtype)}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        self.model = mmm.load_causal_lm(self.model_path, **kwargs).to(self.device).eval()
        self.multimodal = mmm.is_multimodal(self.model)
        self.banned_ids = mmm.banned_token_ids(self.model)  # media tokens, never sampled
        self._banned_t = torch.tensor(self.banned_ids, dtype=torch.long, device=self.device)
        self.dtype = next(self.model.parameters()).dtype
        self.config = self.model.config
        self.tokenizer = load_tokenizer(self.model_path)
        self.weight_version = version_to_engine(weight_version)
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
        self.cache = PagedKVCache(
            int(text_cfg.num_hidden_layers),
            int(getattr(text_cfg, "num_key_value_heads", None) or heads),
            int(head_dim),
            self.dtype,
            self.device,
            max_context=self.max_context_len,
        )
        # the additive mask's two values, 0-dim tensors of the model's dtype (see `_mask`)
        self._attend = torch.zeros((), dtype=self.dtype, device=self.device)
        self._masked = torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
        # one prompt past its cached columns attends with a causal mask aligned to the bottom right, never
        # materialised (`prefill_after`); on the CPU, where SDPA would only materialise it, a dense mask
        self.lower_right = self.device.type == "cuda"
        # suffixes past cached prefixes as one variable-length flash call per layer (`packed_prefill.py`)
        self.packed_prefill = self.lean is not None and packed_prefill.available(self.device, self.dtype)
        # rotary positions reach at most this far past a row's cache column: the largest rope delta seen,
        # rounded up to `ROPE_MARGIN_STEP` (0 for text models; a media prompt's delta is mostly negative)
        self.rope_margin = 0
        self.graphs = None  # decode CUDA graphs: CUDA and the lean decoder; the rope delta an input
        if cuda_graphs and self.device.type == "cuda" and self.lean is not None:
            self.graphs = DecodeGraphs(
                self._decode_forward, self.cache, self.device, rope_delta=self.multimodal
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
        return torch.where(allowed, self._attend, self._masked).unsqueeze(1)

    def _attention_kernels(self) -> contextlib.AbstractContextManager:
        return sdpa_kernel(SDPA_BACKENDS) if self.device.type == "cuda" else contextlib.nullcontext()

    def _hidden(
        self,
        ids: Tensor,
        mask: Tensor | None,
        pos: Tensor,
        cache: PagedKVCache,
        lengths: Tensor | None = None,
        rope_len: int = 0,
    ) -> Tensor:
        with self._attention_kernels():
            if self.lean is not None:
                return self.lean(ids, mask, pos, cache, lengths, rope_len)
            out = self.decoder(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
        return out.last_hidden_state

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], slots: list[int]) -> Tensor:
        """Right-padded batched prefill of prompt u into table row slots[u] of the KV cache (whose blocks
        must hold it); returns the logits of each prompt's last token [U, V]."""
        T = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), T, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        lens_U = torch.tensor([len(p) for p in prompts], device=self.device)
        col_T = torch.arange(T, device=self.device)
        mask = None  # the lean decoder: causal (see `LeanDecoder.__call__`)
        if self.lean is None:
            causal_TT = col_T[None, :] <= col_T[:, None]
            mask = self._mask(causal_TT[None] & (col_T[None, None, :] < lens_U[:, None, None]))
        pos = col_T.unsqueeze(0).expand(len(prompts), T)
        rows = torch.tensor(slots, device=self.device)
        h = self._hidden(ids.to(self.device), mask, pos, self.cache.for_prefill(rows))
        last_UH = h[torch.arange(len(prompts), device=self.device), lens_U - 1]
        return self._logits(last_UH)

    @torch.inference_mode()
    def prefill_after(self, suffixes: list[list[int]], slots: list[int], starts: list[int]) -> Tensor:
        """Prefill of prompts whose first starts[u] tokens already have their KV in table row slots[u] (a
        prefix-cache hit, earlier chunks): suffix u goes to columns starts[u].. and attends over the row's
        columns before it and causally over itself. Returns the logits of each suffix's last token [U, V].

        With `packed_prefill` (the lean decoder on CUDA in 16 bits) the suffixes attend through one
        variable-length flash call per layer over exactly their rows' columns. Otherwise it takes the
        masked attention path (the slot's earlier columns are keys the suffix did not
        compute), not the plain causal prefill of `prefill`. A lone suffix of the lean decoder (a chunk of
        a chunked prefill, one prefix-cache hit) on CUDA attends by the causal mask aligned to the bottom
        right over exactly its slot's columns: SDPA's flash kernel, where a dense mask of T x K (a 256 MiB
        tensor for 8192 tokens over 16k columns) takes the memory-efficient kernel reading it whole."""
        U, T = len(suffixes), max(len(p) for p in suffixes)
        ids = torch.zeros(U, T, dtype=torch.long)
        for i, p in enumerate(suffixes):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        start_U = torch.tensor(starts, device=self.device)
        lens_U = torch.tensor([len(p) for p in suffixes], device=self.device)
        pos_UT = start_U[:, None] + torch.arange(T, device=self.device)[None, :]  # cache column = position
        packed = None
        if self.packed_prefill and T > 1:
            packed = mask = packed_prefill.plan(starts, [len(p) for p in suffixes], T, self.device)
            K = packed.max_k
        elif U == 1 and T > 1 and self.lean is not None and self.lower_right:
            K = starts[0] + T  # no padding: query t sees columns 0..starts[0] + t
            mask = causal_lower_right(T, K)
        else:
            K = min(-(-(max(starts) + T) // 16) * 16, self.cache.capacity)  # aligned rows for the SDPA mask
            col_K = torch.arange(K, device=self.device)
            mask = self._mask(col_K[None, None, :] <= pos_UT[:, :, None])  # [U, 1, T, K]; padding sees 0..
        rows = torch.tensor(slots, device=self.device)
        cache = self.cache.for_prefill(rows, pos_UT, K, packed)
        h = self._hidden(ids.to(self.device), mask, pos_UT, cache)
        last_UH = h[torch.arange(U, device=self.device), lens_U - 1]
        return self._logits(last_UH)

    @torch.inference_mode()
    def prefill_multimodal(
        self, prompts: list[list[int]], slots: list[int], inputs: list[dict[str, Tensor] | None]
    ) -> tuple[Tensor, list[int]]:
        """`prefill` for a multimodal model: prompt u with media `inputs[u]` (or None) through the model
        body at its mrope positions; returns the last-token logits [U, V] and each prompt's rope delta."""
        T = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), T, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        lens_U = torch.tensor([len(p) for p in prompts], device=self.device)
        col_T = torch.arange(T, device=self.device)
        real_UT = (col_T[None, :] < lens_U[:, None]).long()
        allowed = (col_T[None, :] <= col_T[:, None])[None] & real_UT[:, None, :].bool()
        media = mmm.concat_inputs(inputs, self.device)
        pos, delta_U = mmm.rope_positions(self.model, ids, real_UT, media)  # [3, U, T], [U]
        for key in ("pixel_values", "pixel_values_videos", "input_features"):
            if key in media:
                media[key] = media[key].to(self.dtype)
        cache = self.cache.for_prefill(torch.tensor(slots, device=self.device))
        with self._attention_kernels():
            out = mmm.inner_model(self.model)(
                input_ids=ids,
                attention_mask=self._mask(allowed),
                position_ids=pos,
                use_cache=True,
                **{self._cache_kwarg: cache},
                **media,
            )
        last_UH = out.last_hidden_state[torch.arange(len(prompts), device=self.device), lens_U - 1]
        deltas = [int(d) for d in delta_U]
        self._widen_rope_margin(max(deltas))
        return self._logits(last_UH), deltas

    def _widen_rope_margin(self, delta: int) -> None:
        """Rows may now decode at rotary positions up to `delta` past their cache column. The lean decoder's
        rotary table must cover them: a wider margin drops the decode graphs, captured with the old one."""
        if delta <= self.rope_margin:
            return
        self.rope_margin = -(-delta // ROPE_MARGIN_STEP) * ROPE_MARGIN_STEP
        if self.graphs is not None:
            self.graphs.drop()

    def check_multimodal(self, input_ids: list[int], inputs: dict[str, Tensor]) -> None:
        """Raise ValueError when the media tensors do not match the prompt's media tokens."""
        if not self.multimodal:
            raise ValueError(f"{self.model_path} is a text-only model; it takes no multimodal_inputs")
        cfg, ids = self.model.config, torch.tensor(input_ids)
        merge2 = cfg.vision_config.spatial_merge_size**2 if hasattr(cfg, "vision_config") else 1
        for grid_key, token_id in (
            ("image_grid_thw", cfg.image_token_id),
            ("video_grid_thw", cfg.video_token_id),
        ):
            want = int(inputs[grid_key].prod(-1).sum()) // merge2 if grid_key in inputs else 0
            have = int((ids == token_id).sum())
            if want != have:
                raise ValueError(
                    f"the prompt holds {have} media tokens {token_id} but {grid_key} describes {want}; "
                    "build prompt and tensors with the same processor"
                )

    @torch.inference_mode()
    def decode(
        self, tokens_B: Tensor, pos_B: Tensor, length: int, rope_delta_B: Tensor | None = None
    ) -> Tensor:
        """One step for rows 0..B-1: token b at cache column pos_B[b], attending over `length` columns of
        the cache (> max(pos_B)); its rotary position is pos_B[b] + rope_delta_B[b] (multimodal models).
        Returns the logits [B, V]."""
        if self.graphs is not None and self.graphs.supports(tokens_B.shape[0]):
            return self.graphs.run(tokens_B, pos_B, length, rope_delta_B)
        return self._decode_forward(tokens_B, pos_B, None, length, rope_delta_B)

    def _decode_forward(
        self,
        tokens_B: Tensor,
        pos_B: Tensor,
        rows_B: Tensor | None,
        length: int,
        rope_delta_B: Tensor | None = None,
    ) -> Tensor:
        """`decode` of cache rows `rows_B` (None: 0..B-1), eagerly; what the CUDA graphs capture."""
        cache = self.cache.for_decode(pos_B, length, rows_B)
        rope_B = pos_B if rope_delta_B is None else pos_B + rope_delta_B
        if self.lean is not None and self.lean.triton_decode:  # attends by length, needs no mask
            mask, lengths_B = None, pos_B + 1
        else:
            col_L = torch.arange(length, device=self.device)
            mask, lengths_B = self._mask((col_L.unsqueeze(0) <= pos_B.unsqueeze(1)).unsqueeze(1)), None
        h = self._hidden(
            tokens_B.unsqueeze(1), mask, rope_B.unsqueeze(1), cache, lengths_B, length + self.rope_margin
        )
        return self._logits(h[:, 0])

    def _logits(self, h: Tensor) -> Tensor:
        """LM head; a multimodal model's media tokens get `BANNED_LOGIT` (never sampled)."""
        return mmm.mask_media_logits(self.lm_head(h), self._banned_t)

    # -- weights -----------------------------------------------------------------------------------
    def check_weights(self, items: list[tuple[str, Tensor]]) -> None:
        """Raise for a name the model lacks or a shape that differs from the model's."""
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

    @torch.no_grad()
    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        weight_version: str | None = None,
        refresh: bool = True,
    ) -> int:
        """Copy tensors into the parameters of the same (Hugging Face) names; returns how many were set.
        `refresh`: rebuild the lean decoder's fused weights now (False for all but the last bucket).

        Every name is checked before anything is copied, so a bad update leaves the model unchanged.
        """
        items = list(named_tensors)
        self.check_weights(items)
        for name, tensor in items:
            self._params[name].data.copy_(tensor)
        if self.lean is not None and refresh:
            self.lean.refresh()
        if weight_version is not None:
            self.weight_version = version_to_engine(weight_version)
        return len(items)
