"""`ChatSession`: one sample's agent, as the `OpenAIBackend` of the agent endpoint (the routes are the
engine's own, `relax.engine_api.openai`), generated token-in, token-out.

Each call's prompt extends the token sequence of the earlier call it continues (`SessionRecorder.
find_parent`): earlier tokens are reused as they were generated and only the new messages are encoded.
A call that continues nothing is rendered from its messages with the chat template (a new branch).
Every call is recorded, so the session's trajectories can be rebuilt (`SessionRecorder`); a legacy
completion is recorded as a root call of its own.

Sampling: the behaviour policy's parameters (`defaults`) unless the request sets them; every parameter
the request sets (stop strings, seed, logit bias, constraints, ...) goes to the engine; `max_tokens` is
capped at `max_tokens_cap`; the session's stop tokens always end a call. One sample per call (`n` = 1):
each call is one step of the trajectory.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from relax.agentic.trajectory import CallRecord, SessionRecorder, normalize_message
from relax.agentic.turns import TurnFormatter
from relax.engine_api.client import EngineRequestError
from relax.engine_api.openai.backend import ChatPrompt, Choice, OnTokens
from relax.engine_api.openai.errors import OpenAIError
from relax.engine_api.openai.messages import TemplateOptions, template_messages
from relax.engine_api.protocol import version_from_engine

__all__ = ["ChatSession", "template_messages"]

GenerateFn = Callable[..., Awaitable[Any]]  # (prompt ids, params, **client kwargs) -> one GenerateOutput


@dataclass
class _CallState:
    parent: CallRecord | None
    messages: list[tuple]  # normalized request messages
    tools_key: str
    index: int  # the call's index when it was asked (names its tool calls)


class ChatSession:
    max_n = 1
    n_refusal = "each call is one step of the sample's trajectory; make n calls instead"
    reasoning_parser = None  # replies are trained on as the model wrote them

    def __init__(
        self,
        session_id: str,
        formatter: TurnFormatter,
        generate: GenerateFn,
        *,
        defaults: dict[str, Any],
        max_tokens_cap: int,
        stop_token_ids: list[int],
        model_name: str = "relax-policy",
        on_record: Callable[[ChatSession, CallRecord], None] | None = None,
    ) -> None:
        self.session_id = session_id
        self.formatter = formatter
        self.tokenizer = formatter.tokenizer
        self._generate = generate
        self.defaults = defaults  # temperature, top_p, ... of the behaviour policy
        self.max_tokens_cap = max_tokens_cap
        self.stop_token_ids = list(stop_token_ids)
        self.model_name = model_name
        self.on_record = on_record  # called with each recorded call (the dev server writes it out)
        self.recorder = SessionRecorder()
        self._lock = asyncio.Lock()  # calls are recorded in the order they are made

    # -- OpenAIBackend ------------------------------------------------------------------------
    async def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        options: TemplateOptions | None = None,
    ) -> ChatPrompt:
        if options is not None and not options.is_default:
            # the trajectory is rendered as training renders its prompts (turns.TurnFormatter)
            raise OpenAIError(
                "the agent endpoint renders calls as the run's chat template does: chat_template_kwargs, "
                "reasoning_effort, add_generation_prompt and continue_final_message are not served here",
                400,
            )
        async with self._lock:
            ids, parent, norm, tools_key = self.prompt_for(messages, tools)
            return ChatPrompt(ids, _CallState(parent, norm, tools_key, len(self.recorder.calls)))

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        return list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)

    async def generate(
        self,
        prompt_ids: list[int],
        params: dict[str, Any],
        *,
        top_logprobs: int = 0,
        on_tokens: OnTokens | None = None,
    ) -> list[Choice]:
        want = params.get("max_new_tokens")
        merged = {
            **self.defaults,
            **params,
            "n": 1,
            "max_new_tokens": min(
                int(want if want is not None else self.max_tokens_cap), self.max_tokens_cap
            ),
            "stop_token_ids": sorted(set(self.stop_token_ids) | set(params.get("stop_token_ids") or [])),
        }
        kwargs: dict[str, Any] = {"top_logprobs_num": top_logprobs} if top_logprobs else {}
        if on_tokens is not None:
            seen = [0]

            def on_chunk(_index: int, out: Any) -> None:
                k = seen[0]
                tops = out.output_top_logprobs[k:] or [None] * (len(out.output_ids) - k)
                on_tokens(0, out.output_ids[k:], out.output_log_probs[k:], tops)
                seen[0] = len(out.output_ids)

            kwargs["on_chunk"] = on_chunk
        try:
            out = await self._generate(prompt_ids, merged, **kwargs)
        except EngineRequestError as e:
            raise OpenAIError(e.message, 400 if e.status < 500 else 503) from e
        version = (out.weight_versions or [out.weight_version])[0]
        return [Choice(list(out.output_ids), [float(x) for x in out.output_log_probs], out.finish_reason, out.text,
                       out.output_top_logprobs, version)]  # fmt: skip

    async def record(self, prompt: ChatPrompt, choices: list[Choice], replies: list[dict[str, Any]]) -> None:
        (choice,), (reply,) = choices, replies
        state = prompt.state
        if state is None:  # a legacy completion: a root call of its own
            text = self.tokenizer.decode(prompt.prompt_ids, skip_special_tokens=False)
            state = _CallState(None, [("completion", text, ())], "completion", len(self.recorder.calls))
        async with self._lock:
            rec = CallRecord(
                index=len(self.recorder.calls),
                messages=state.messages,
                tools_key=state.tools_key,
                reply=normalize_message(reply),
                prompt_ids=list(prompt.prompt_ids),
                output_ids=list(choice.output_ids),
                log_probs=list(choice.logprobs),
                # the oldest weights of the call (a call updated in place spans two)
                weight_version=version_from_engine(choice.weight_version),
                finish_reason=choice.finish_reason,
                parent=None if state.parent is None else state.parent.index,
                reply_message=reply,
            )
            self.recorder.add(rec)
        if self.on_record is not None:
            self.on_record(self, rec)

    def tool_call_id(self, prompt: ChatPrompt, k: int) -> str:
        index = prompt.state.index if prompt.state is not None else len(self.recorder.calls)
        return f"call_{self.session_id}_{index}_{k}"

    # -- prompts --------------------------------------------------------------------------------
    def prompt_for(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None):
        """(prompt ids, parent call or None, normalized messages, tools key) for a request."""
        norm = [normalize_message(m) for m in messages]
        tools_key = json.dumps(tools or [], sort_keys=True)
        parent = self.recorder.find_parent(norm, tools_key)
        if parent is None:
            ids = self.formatter.prompt_ids(template_messages(messages), tools=tools or None)
            return ids, None, norm, tools_key
        rest = template_messages(messages[len(parent.messages) + 1 :])
        ended = bool(parent.output_ids) and parent.output_ids[-1] in self.stop_token_ids
        text = ("" if ended else self.formatter.eos_text) + self.formatter.messages_text(rest)
        ids = (
            parent.prompt_ids
            + parent.output_ids
            + list(self.tokenizer.encode(text, add_special_tokens=False))
        )
        return ids, parent, norm, tools_key
