"""What the OpenAI routes need from the thing that generates: an `OpenAIBackend`. Two implement it: the
embedded engine (`relax.backends.inference.embedded.http.openai_backend`) and an external agent's session
(`relax.agentic.session.ChatSession`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from relax.engine_api.openai.messages import TemplateOptions

# Streaming: (choice index, new token ids, their log-probs, their top log-probs or Nones)
OnTokens = Callable[[int, list[int], list[float], list[Any]], None]


@dataclass
class ChatPrompt:
    """A chat request's prompt as tokens, with what the backend needs to record the call afterwards."""

    prompt_ids: list[int]
    state: Any = None  # the backend's own (a session's parent call and normalized messages)


@dataclass
class Choice:
    """One generated sample."""

    output_ids: list[int]
    logprobs: list[float]  # of each output token, as sampled
    finish_reason: str  # stop | length | abort
    text: str  # the output text (cut before a matched stop string)
    top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)  # per token, when asked
    weight_version: str | None = None  # the oldest weights it was sampled under


class OpenAIBackend(Protocol):
    tokenizer: Any
    model_name: str
    # the most samples one request may ask for (None: no limit) and why, for the error
    max_n: int | None
    n_refusal: str
    # the reasoning parser of chat replies (`reasoning.REASONING_PARSERS`; None: replies are not split)
    reasoning_parser: str | None

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        options: TemplateOptions | None = None,
    ) -> ChatPrompt:
        """The prompt tokens of a chat request rendered with `options` (None: the defaults); raises
        OpenAIError for a request it cannot render."""
        ...

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        """The prompt tokens of a legacy completion."""
        ...

    async def generate(
        self,
        prompt_ids: list[int],
        params: dict[str, Any],
        *,
        top_logprobs: int = 0,
        on_tokens: OnTokens | None = None,
    ) -> list[Choice]:
        """`params['n']` samples; `params` holds SGLang sampling parameters, only those the request set
        (the backend fills in its defaults). Raises OpenAIError for a request the engine refuses."""
        ...

    async def record(self, prompt: ChatPrompt, choices: list[Choice], replies: list[dict[str, Any]]) -> None:
        """A chat call finished with these replies (the agent's session records it; the engine does not)."""
        ...

    def tool_call_id(self, prompt: ChatPrompt, k: int) -> str: ...
