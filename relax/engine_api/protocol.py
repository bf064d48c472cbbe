"""Request bodies of the inference-engine HTTP protocol: the subset of SGLang's native server API that RL
needs, with SGLang's field names (`sglang/srt/managers/io_struct.py`, `sampling_params.py`).

The embedded engine's server validates requests with these models; unknown fields are errors
(`extra="forbid"`), so a typo is answered with a 400 that names it instead of silently doing nothing.
SGLang fields that the embedded engine accepts but does not implement must keep their default value.

Responses follow SGLang too. `/generate` answers, per prompt and sample (a list for batched input or
n > 1, grouped by prompt: p0s0, p0s1, p1s0, ...)::

    {"text": str, "output_ids": [int],
     "meta_info": {"id": str, "finish_reason": {"type": "stop", "matched": int | str}
                                             | {"type": "length", "length": int}
                                             | {"type": "abort", "message": str},
                   "prompt_tokens": int, "completion_tokens": int, "cached_tokens": int,
                   "output_token_logprobs": [[logprob, token_id, text | None], ...],
                   "weight_version": str, "e2e_latency": float}}
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(Strict):
    """Per-request sampling parameters (SGLang names and defaults)."""

    max_new_tokens: int = Field(128, ge=0, description="Cap on generated tokens (clamped to the context).")
    temperature: float = Field(1.0, ge=0.0, description="Softmax temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept (1 = off).")
    top_k: int = Field(-1, description="Keep the k most likely tokens (-1 = off).")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * max prob (0 = off).")
    n: int = Field(1, ge=1, description="Samples per prompt; they share the prompt's prefill.")
    stop: str | list[str] | None = Field(None, description="Stop strings (need a tokenizer).")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end generation.")
    ignore_eos: bool = Field(False, description="Do not stop at the model's EOS token.")
    skip_special_tokens: bool = Field(True, description="Drop special tokens from the returned text.")
    spaces_between_special_tokens: bool = Field(True, description="Accepted for compatibility.")
    no_stop_trim: bool = Field(False, description="Keep the matched stop string in the returned text.")
    sampling_seed: int | None = Field(None, description="Seed of this request's own generator.")
    # SGLang fields the embedded engine does not implement: only their neutral value is accepted.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 1 and v != -1:
            raise ValueError("top_k must be -1 (off) or at least 1")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingParams:
        neutral = {
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "repetition_penalty": 1.0,
            "min_new_tokens": 0,
        }
        for name, value in neutral.items():
            if getattr(self, name) != value:
                raise ValueError(
                    f"{name}={getattr(self, name)} is not supported by this engine; leave it at {value}"
                )
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class GenerateRequest(Strict):
    """Body of `POST /generate` (SGLang `GenerateReqInput`, the fields RL uses)."""

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    # Relax extension: each prompt's media tensors (pixel values, grids, audio features), safetensors
    # bytes in base64 (`relax.data.mm_codec`); a list for batched input (None for a text prompt).
    multimodal_inputs: str | list[str | None] | None = None

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if self.stream:
            raise ValueError("stream=true is not supported by this engine")
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("give exactly one of input_ids or text")
        for name in ("top_logprobs_num",):
            v = getattr(self, name)
            if v not in (None, 0) and not (isinstance(v, list) and not any(v)):
                raise ValueError(f"{name} is not supported by this engine")
        return self

    @property
    def is_batch(self) -> bool:
        if self.input_ids is not None:
            return bool(self.input_ids) and isinstance(self.input_ids[0], list)
        return isinstance(self.text, list)


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

    forward_sleep_time: float | None = Field(None, ge=0.0)


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
