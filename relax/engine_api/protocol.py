"""Request bodies of the inference-engine HTTP protocol: the subset of SGLang's native server API that RL
needs, with SGLang's field names (`sglang/srt/managers/io_struct.py`, `sampling_params.py`).

The embedded engine's server validates requests with these models. `/generate` takes SGLang's whole
`GenerateReqInput` and `SamplingParams` schema: a field the engine implements works as in SGLang, a field
it does not implement is accepted at its neutral value (`UNSUPPORTED_*`; SGLang's own clients send some
on every request) and answered 400 naming it otherwise, and a field SGLang does not know (a typo) is a
400 too: nothing is silently ignored.

Responses follow SGLang too. `/generate` answers, per prompt and sample (a list for batched input or
n > 1, grouped by prompt: p0s0, p0s1, p1s0, ...)::

    {"text": str, "output_ids": [int],
     "meta_info": {"id": str, "finish_reason": {"type": "stop", "matched": int | str}
                                             | {"type": "length", "length": int}
                                             | {"type": "abort", "message": str},
                   "prompt_tokens": int, "completion_tokens": int, "cached_tokens": int,
                   "output_token_logprobs": [[logprob, token_id, text | None], ...],
                   "output_top_logprobs": [[[logprob, token_id, text | None], ...] | None, ...],
                   "input_token_logprobs": [[logprob | None, token_id, text | None], ...],
                   "input_top_logprobs": [...],
                   "weight_version": str, "e2e_latency": float}}

The logprob fields appear with `return_logprob`: `output_*` always, `input_*` when `logprob_start_len`
>= 0 (from that prompt position on; position 0 has no log-prob: None), the `*_top_logprobs` lists when
`top_logprobs_num` > 0. With `stream: true` the answer is server-sent events, one `data: {...}` per
step that produced tokens (text, output ids and logprobs cumulative, `finish_reason` null until the
last), then `data: [DONE]`; several prompts or samples are told apart by `index`. Relax's client asks
Relax's engines for the finished reply packed instead (`relax.engine_api.packed`, by `Accept`).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def is_neutral(value: Any, neutral: Any) -> bool:
    """A value that asks for nothing: the field's neutral value, null, an empty container, or (batched
    input) a list of such values."""
    if value is None or value == neutral or (isinstance(value, (list, dict, str)) and not value):
        return True
    return isinstance(value, list) and all(is_neutral(v, neutral) for v in value)


def check_fields(data: Any, neutral: dict[str, Any], ignored: frozenset[str], what: str) -> Any:
    """Drop from a request body the SGLang fields the engine accepts but does not implement: those in
    `neutral` must hold their neutral value (else the ValueError names the field), those in `ignored`
    (bookkeeping: they change nothing that is generated) may hold anything."""
    if not isinstance(data, dict):
        return data
    out = {}
    for name, value in data.items():
        if name in neutral:
            if not is_neutral(value, neutral[name]):
                raise ValueError(
                    f"{what}{name}={value!r} is not supported by this engine; leave it out or at "
                    f"{neutral[name]!r}"
                )
        elif name not in ignored:
            out[name] = value
    return out


# SGLang `SamplingParams` fields the embedded engine does not implement: only their neutral value passes
# (null or an empty value too). The last group are SGLang's internal fields, filled by its own
# normalisation and never by callers.
UNSUPPORTED_SAMPLING = {
    "repetition_penalty": 1.0,
    "beam_width": 1,
    "structural_tag": None,
    "custom_params": None,
    "watermark": None,
    "stop_strs": None,
    "stop_regex_strs": None,
    "stop_str_max_len": 0,
    "stop_regex_max_len": 0,
    "is_normalized": False,
    "ebnf_full_assistant": False,
}
GRAMMARS = ("regex", "json_schema", "ebnf")
GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (SGLang's threshold)
# OpenAI's bound on a logit bias: +-100 already bans or forces a token, and a larger (or non-finite) value
# overflows the logits to inf / NaN once divided by a small temperature
MAX_LOGIT_BIAS = 100.0
MAX_FORWARD_SLEEP_S = 60.0  # `/slow_down`'s bound: a longer sleep per step is a stalled engine


class SamplingParams(Strict):
    """Per-request sampling parameters (SGLang names and defaults). SGLang's fields that the engine does
    not implement (`UNSUPPORTED_SAMPLING`) are accepted at their neutral value only; null means a
    field's default, as in SGLang. A grammar (`regex`, `json_schema`, `ebnf`: at most one) restricts
    every sampled token to those that keep the output a prefix of a match (`embedded/sampling/grammar.py`)."""

    max_new_tokens: int = Field(128, ge=0, description="Cap on generated tokens (clamped to the context).")
    temperature: float = Field(
        1.0, ge=0.0, allow_inf_nan=False, description="Softmax temperature; 0 = greedy."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept (1 = off).")
    top_k: int = Field(-1, description="Keep the k most likely tokens (-1 = off).")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob (0 = off).")
    n: int = Field(1, ge=1, description="Samples per prompt; they share the prompt's prefill.")
    stop: str | list[str] | None = Field(None, description="Stop strings (need a tokenizer).")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end generation.")
    stop_regex: str | list[str] | None = Field(
        None,
        description="Regular expressions (RE2 syntax: no backreferences or lookaround) that end generation "
        "when the output text matches one.",
    )
    ignore_eos: bool = Field(False, description="Do not stop at the model's EOS token.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from the returned text.")
    spaces_between_special_tokens: bool = Field(True, description="Accepted for compatibility.")
    no_stop_trim: bool = Field(False, description="Keep the matched stop string in the returned text.")
    sampling_seed: int | None = Field(None, description="Seed of this request's own generator.")
    regex: str | None = Field(None, description="Constrain the output to this regular expression.")
    json_schema: str | dict[str, Any] | None = Field(
        None, description="Constrain the output to JSON valid under this schema (a JSON string or object)."
    )
    ebnf: str | None = Field(None, description="Constrain the output to this grammar (GBNF or Lark).")
    logit_bias: dict[str, float] | None = Field(
        None,
        description="Added to the logits of these token ids (keys: ids as strings, as in OpenAI; values "
        "finite, within +-100).",
    )
    stream_interval: int | None = Field(
        None, ge=1, description="Streaming: one chunk every this many tokens (default 1)."
    )
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted from the logit of every token already generated (OpenAI's; prompt tokens "
        "do not count).",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted from a token's logit once per time it was generated (OpenAI's).",
    )
    min_new_tokens: int = Field(
        0,
        ge=0,
        description="Stop tokens (EOS, stop_token_ids) are masked and stop strings do not end the output "
        "before this many tokens.",
    )

    @model_validator(mode="before")
    @classmethod
    def _sglang_fields(cls, data: Any) -> Any:
        data = check_fields(data, UNSUPPORTED_SAMPLING, frozenset(), "")
        if isinstance(data, dict):  # null means the default, as in SGLang; an empty grammar means none
            fields = cls.model_fields
            data = {
                k: v
                for k, v in data.items()
                if not (v is None and k in fields and fields[k].default is not None)
            }
            data = {k: (None if k in GRAMMARS and v == "" else v) for k, v in data.items()}
        return data

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, v: float) -> float:
        # Dividing logits by a temperature this small overflows them to inf (NaN probabilities that
        # fail the sampling step); SGLang treats it as greedy, and so does this engine.
        return 0.0 if v < GREEDY_TEMPERATURE else v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 1 and v != -1:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias(v)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        bad = [t for t in v or [] if t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0; got {bad[:5]}")
        return v

    @field_validator("stop_regex")
    @classmethod
    def _stop_regex(cls, v: str | list[str] | None) -> str | list[str] | None:
        from relax.engine_api.stop_regex import compile_stop_regex  # google-re2, loaded when needed

        for pattern in [v] if isinstance(v, str) else v or []:
            if pattern:
                compile_stop_regex(pattern)
        return v

    @model_validator(mode="after")
    def _min_new_tokens(self) -> SamplingParams:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} is above max_new_tokens={self.max_new_tokens}"
            )
        return self

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingParams:
        given = [g for g in GRAMMARS if getattr(self, g) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of regex, json_schema and ebnf; got {', '.join(given)}")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    @property
    def stop_regexes(self) -> list[str]:
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else [s for s in self.stop_regex if s]

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the output constraint, or None for free generation."""
        for kind in GRAMMARS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value if isinstance(value, str) else json.dumps(value)
        return None


# SGLang `GenerateReqInput` fields the embedded engine does not implement: only their neutral value
# passes (the media fields: send `multimodal_inputs`, Relax's tensors, instead).
UNSUPPORTED_GENERATE = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None, "mm_hashes": None,
    "mm_content_hashes": None, "use_audio_in_video": False, "video_config": None, "modalities": None,
    "mm_processor_kwargs": None, "watermark": None, "token_ids_logprob": None, "return_sampling_mask": False,
    "sampling_logprobs_mode": None, "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False, "return_flat_raw_top_logprobs_b64": False,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_indexer_topk": False, "return_bytes": False, "return_entropy": False,
    "return_prompt_token_ids": False, "session_params": None, "lora_path": None, "lora_id": None,
    "custom_logit_processor": None, "positional_embed_overrides": None, "bootstrap_host": None,
    "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None, "decode_tp_size": None,
    "routed_dp_rank": None, "data_parallel_rank": None, "disagg_prefill_dp_rank": None, "kv_router_hint": None,
    "kv_hints": None, "background": False, "require_reasoning": False, "max_thinking_tokens": None,
    "priority": None, "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None,
    "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "images_config": None, "multi_item_delimiter_indices": None,
    "token_indices_to_pool": None,
}  # fmt: skip
# Bookkeeping fields of `GenerateReqInput` (metrics, logging, routing and cache keys, tracing): any value
# is accepted; none changes what is generated (the prefix cache reuses only KV that the same tokens
# produced under the same weights, so cache keys such as `cache_salt` could change hit rates, not outputs).
IGNORED_GENERATE = frozenset(
    {
        "log_metrics", "no_logs", "custom_labels", "external_trace_header", "received_time",
        "session_id", "conversation_id", "routing_key", "extra_key", "cache_salt", "http_worker_ipc",
    }
)  # fmt: skip


class GenerateRequest(Strict):
    """Body of `POST /generate` (SGLang `GenerateReqInput`): every SGLang field is accepted, those the
    engine does not implement only at their neutral value (`UNSUPPORTED_GENERATE`, `IGNORED_GENERATE`);
    any other field is a 400 naming it."""

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    # -1 (or null): log-probs of the output only; k: of the prompt tokens from position k on too
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None  # the k most likely tokens at each position
    return_text_in_logprobs: bool = False
    # Relax extension: each prompt's media tensors (pixel values, grids, audio features), safetensors
    # bytes in base64 (`relax.data.mm_codec`); a list for batched input (None for a text prompt).
    multimodal_inputs: str | list[str | None] | None = None

    @model_validator(mode="before")
    @classmethod
    def _sglang_fields(cls, data: Any) -> Any:
        return check_fields(data, UNSUPPORTED_GENERATE, IGNORED_GENERATE, "")

    @field_validator("text")
    @classmethod
    def _text(cls, v: str | list[str] | None) -> str | list[str] | None:
        return check_unicode(v, "text")

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of input_ids or text")
        if any(x is not None and x < -1 for x in _listed(self.logprob_start_len)):
            raise ValueError("logprob_start_len must be -1 (output only) or a prompt position >= 0")
        if any(x is not None and x < 0 for x in _listed(self.top_logprobs_num)):
            raise ValueError("top_logprobs_num must be >= 0")
        return self

    @property
    def is_batch(self) -> bool:
        if self.input_ids is not None:
            return bool(self.input_ids) and isinstance(self.input_ids[0], list)
        return isinstance(self.text, list)


def check_logit_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    """`bias` if its keys are token ids and its values finite and within +-MAX_LOGIT_BIAS (as OpenAI
    bounds them), else a ValueError naming the entry."""
    for key, value in (bias or {}).items():
        if not key.lstrip("-").isdigit():
            raise ValueError(f"logit_bias keys are token ids; got {key!r}")
        if not math.isfinite(value) or abs(value) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"logit_bias[{key!r}]={value!r} is out of range; each bias must be a finite number in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )
    return bias


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def check_unicode(value: Any, field: str) -> Any:
    """`value` if no string in it (nested in lists and dicts too) holds a lone UTF-16 surrogate (a JSON
    escape like "\\ud800" without its pair): such a string has no UTF-8 form, so no tokenizer can take it.
    Else a ValueError naming the field and the position."""
    if isinstance(value, str):
        # an ASCII string (flagged by CPython, no scan) has none
        if not value.isascii() and (m := _SURROGATE.search(value)) is not None:
            raise ValueError(
                f"{field} holds a lone UTF-16 surrogate {m.group()!a} at character {m.start()}; send "
                "valid Unicode text"
            )
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{field}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, f"{field} key")
            check_unicode(item, f"{field}.{key}")
    return value


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


class AbortRequest(Strict):
    """Body of `POST /abort_request`: one request (all its samples) by rid, or every request."""

    rid: str | None = ""
    abort_all: bool = False


class PauseRequest(Strict):
    """Body of `POST /pause_generation`. `abort`: end every request (SGLang's default); `in_place`: stop
    advancing, keep the KV cache; `retract`: stop, drop the KV cache, recompute it on continue."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class SlowDownRequest(Strict):
    """Body of `POST /slow_down`: sleep this long after every step (None or 0 = full speed)."""

    forward_sleep_time: float | None = Field(None, ge=0.0, le=MAX_FORWARD_SLEEP_S, allow_inf_nan=False)


def version_to_engine(version: int | str | None) -> str | None:
    """A weight version as engines carry it: a string (SGLang's `weight_version`); the trainer counts
    versions as ints (its training step). None stays None (a bucket before the last carries none)."""
    return None if version is None else str(version)


def version_from_engine(version: str | int | None, default: int = 0) -> int:
    """The trainer's int for a version an engine reports (`default` when it reports none)."""
    if version is None or version == "":
        return default
    try:
        return int(version)
    except ValueError:
        raise ValueError(
            f"weight version {version!r} is not a training step; an engine in a Relax run must be "
            "started with a numeric weight version (the default, 0)"
        ) from None


class InitWeightsUpdateGroupRequest(Strict):
    """Body of `POST /init_weights_update_group`: join the trainer's weight-sync group as rank
    `rank_offset` (the trainer is rank 0)."""

    master_address: str
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupRequest(Strict):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedRequest(Strict):
    """Body of `POST /update_weights_from_distributed`: receive these tensors, in this order, by one
    broadcast each from rank 0 of the group (`load_format="flattened_bucket"`: one broadcast of the
    bucket packed as `relax.weights.ipc.layout` describes), and load them by name."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: Literal["flattened_bucket"] | None = None
    torch_empty_cache: bool = False

    @model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromDistributedRequest:
        _check_lengths(self.names, self.dtypes, self.shapes)
        return self


class UpdateWeightsFromIpcRequest(Strict):
    """Body of `POST /update_weights_from_ipc` (Relax only): the bucket packed in a CUDA buffer of the
    sender on this receiver's GPU, as `relax.weights.ipc.share` describes it."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    handle: dict[str, Any]
    flush_cache: bool = True
    weight_version: str | None = None

    @model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromIpcRequest:
        _check_lengths(self.names, self.dtypes, self.shapes)
        return self


def _check_lengths(names: list, dtypes: list, shapes: list) -> None:
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(
            f"names, dtypes and shapes must have one entry per tensor; got "
            f"{len(names)}, {len(dtypes)}, {len(shapes)}"
        )


class UpdateWeightsFromDiskRequest(Strict):
    """Body of `POST /update_weights_from_disk`: load every `*.safetensors` file of `model_path`."""

    model_path: str
    weight_version: str | None = None
    load_format: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True
    torch_empty_cache: bool = False
    keep_pause: bool = False
    is_async: bool = False
    token_step: int = 0
    recapture_cuda_graph: bool = False
