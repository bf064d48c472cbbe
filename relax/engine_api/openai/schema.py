"""Request bodies of the OpenAI-compatible routes. Every documented OpenAI parameter is accepted: those
served change what is generated; those not served (`UNSUPPORTED_*`) pass only at their neutral value
(else a 400 naming the parameter); bookkeeping ones (`IGNORED`) may hold anything. A parameter OpenAI
does not document is a 400 naming it (a typo never passes silently). SGLang's and vLLM's common
extensions (`top_k`, `min_p`, `min_tokens`, `regex`, `ebnf`, `json_schema`, `ignore_eos`,
`stop_token_ids`, `skip_special_tokens`) are served too, and on chat their chat-template and reasoning
fields (`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`, `separate_reasoning`;
`relax.engine_api.openai.messages`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax.engine_api.protocol import check_fields, check_logit_bias, check_unicode

# Accepted with any value: they change nothing that is generated.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "verbosity", "safety_identifier", "prompt_cache_key"})  # fmt: skip
UNSUPPORTED_COMMON = {"repetition_penalty": 1.0}
UNSUPPORTED_CHAT = {
    **UNSUPPORTED_COMMON,
    "modalities": ["text"],
    "audio": None,
    "prediction": None,
    "web_search_options": None,
    "functions": None,
    "function_call": None,
}
UNSUPPORTED_COMPLETION = {**UNSUPPORTED_COMMON, "suffix": None, "best_of": 1}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Sampling(BaseModel):
    """Parameters chat and legacy completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's penalties, on the tokens generated so far (the engine's `logit_rows.py`)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    min_tokens: int | None = Field(None, ge=0)  # vLLM's and SGLang's name; the engine's min_new_tokens
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias(v)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # how the messages are rendered (`messages.template_options`); add_generation_prompt None: true
    # unless the final message is continued
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    separate_reasoning: bool = True  # reasoning_content apart from content (with a reasoning parser)

    @model_validator(mode="before")
    @classmethod
    def _openai_fields(cls, data: Any) -> Any:
        return check_fields(data, UNSUPPORTED_CHAT, IGNORED, "")

    @field_validator("messages", "tools")
    @classmethod
    def _unicode(cls, v: Any, info: Any) -> Any:
        return check_unicode(v, info.field_name)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for legacy completions
    logprobs: int | None = Field(None, ge=0, le=20)  # top log-probs per token (0: the chosen token's only)
    echo: bool = False  # the prompt before the completion, in the text and the log-probs (lm-eval's scoring)

    @model_validator(mode="before")
    @classmethod
    def _openai_fields(cls, data: Any) -> Any:
        return check_fields(data, UNSUPPORTED_COMPLETION, IGNORED, "")

    @field_validator("prompt")
    @classmethod
    def _unicode(cls, v: Any) -> Any:
        return check_unicode(v, "prompt")

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # one prompt of token ids
        return list(p)
