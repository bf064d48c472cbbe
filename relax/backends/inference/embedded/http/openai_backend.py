"""The embedded engine as an `OpenAIBackend`: chat prompts from the model folder's chat template (tools
listed as the template writes them), generation through `EmbeddedEngine.submit` (n samples sharing one
prefill, streaming through its per-token callback), the engine's refusals as OpenAI 400s."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.backends.inference.embedded.http.prompt_text import encode_prompt
from relax.backends.inference.embedded.scheduling.sequence import GRAMMAR_ABORT
from relax.engine_api.openai.backend import ChatPrompt, Choice, OnTokens
from relax.engine_api.openai.errors import OpenAIError
from relax.engine_api.openai.messages import TemplateOptions, render_chat
from relax.engine_api.protocol import SamplingParams


class EngineOpenAIBackend:
    max_n: int | None = None
    n_refusal = ""

    def __init__(
        self, engine: EmbeddedEngine, model_name: str | None = None, reasoning_parser: str | None = None
    ) -> None:
        self.engine = engine
        path = engine.runner.model_path
        self.model_name = model_name or Path(path).name
        # /v1 requests must name the model (404 otherwise, `routes._check_model`): the name above, or the
        # model path the server was given, as given or resolved (clients configured with the path)
        self.model_aliases = frozenset({path, str(Path(path).resolve()), Path(path).name})
        self.strict_model_names = True
        self.reasoning_parser = reasoning_parser  # splits <think> blocks from replies (relax engine serve)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise OpenAIError("this model folder has no tokenizer; the OpenAI routes need one", 400)
        return self.tokenizer

    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        options: TemplateOptions | None = None,
    ) -> ChatPrompt:
        tok = self._need_tokenizer()
        if getattr(tok, "chat_template", None) is None:
            raise OpenAIError(
                "the model folder's tokenizer has no chat template; use /v1/completions", 400, "messages"
            )
        try:
            text = render_chat(tok, messages, tools, options)
        except OpenAIError:
            raise
        except Exception as e:  # noqa: BLE001 - the template's own complaint (e.g. roles out of order)
            raise OpenAIError(f"the chat template cannot render these messages: {e}", 400, "messages") from e
        return ChatPrompt(self._encode(text, "messages", add_special_tokens=False))

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self._encode(prompt, "prompt")
        return list(prompt)

    def _encode(self, text: str, field: str, **kwargs: Any) -> list[int]:
        """The tokens of a prompt; a text far too long for the context is refused before it is
        tokenized whole (`prompt_text.py`)."""
        try:
            return encode_prompt(self._need_tokenizer(), text, self.engine.max_context_len, field, **kwargs)
        except ValueError as e:
            raise OpenAIError(str(e), 400, field) from e

    async def generate(
        self,
        prompt_ids: list[int],
        params: dict[str, Any],
        *,
        top_logprobs: int = 0,
        on_tokens: OnTokens | None = None,
    ) -> list[Choice]:
        rid = f"oai-{uuid.uuid4().hex}"
        try:
            sp = SamplingParams(**{"max_new_tokens": self.engine.max_context_len, **params})
            grammar = await asyncio.to_thread(self.engine.compile_grammar, sp)
            on_token = None
            if on_tokens is not None:
                on_token = lambda j, t, lp, top: on_tokens(j, [t], [lp], [top])  # noqa: E731
            future = self.engine.submit(prompt_ids, sp, rid=rid, top_logprobs_num=top_logprobs,
                                        on_token=on_token, grammar=grammar)  # fmt: skip
        except ValidationError as e:
            raise OpenAIError(f"invalid sampling parameters: {e.errors()[0].get('msg')}", 400) from e
        except ValueError as e:
            raise OpenAIError(str(e), 400) from e
        except RuntimeError as e:
            raise OpenAIError(str(e), 503) from e
        try:
            results = await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the client went away: queued, not awaited (this task is cancelled)
            self.engine.abort_soon(rid)
            raise
        except RuntimeError as e:
            raise OpenAIError(str(e), 503) from e
        for r in results:  # a grammar the model cannot follow is the request's fault, not a natural stop
            message = str(r.finish_reason.get("message", ""))
            if r.finish_reason.get("type") == "abort" and message.startswith(GRAMMAR_ABORT):
                raise OpenAIError(message, 400, sp.grammar[0] if sp.grammar else None)
        return [
            Choice(
                r.output_ids,
                r.output_logprobs,
                r.finish_reason.get("type", "stop"),
                r.text,
                r.output_top_logprobs,
            )
            for r in results
        ]

    async def prompt_logprobs(
        self, prompt_ids: list[int], top_n: int
    ) -> tuple[list[float | None], list[list[tuple[float, int]] | None]]:
        """Each prompt token's log-prob given those before it (None for the first) and the `top_n` most
        likely tokens there: `echo` on /v1/completions (`relax.engine_api.openai.echo`)."""
        try:
            scored = await asyncio.to_thread(self.engine.prompt_logprobs, prompt_ids, 0, top_n)
        except ValueError as e:
            raise OpenAIError(str(e), 400, "echo") from e
        except RuntimeError as e:
            raise OpenAIError(str(e), 503) from e
        return scored.logprobs, scored.top

    async def record(self, prompt: ChatPrompt, choices: list[Choice], replies: list[dict[str, Any]]) -> None:
        return None

    def tool_call_id(self, prompt: ChatPrompt, k: int) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"
