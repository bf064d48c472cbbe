"""`echo: true` on `/v1/completions`: the prompt comes back before the completion, in the text and (with
`logprobs`) in the legacy log-probs, each prompt token scored given the tokens before it. This is how
lm-eval-harness's `local-completions` scores the choices of a multiple-choice task: it sends context +
continuation as token ids with `max_tokens: 1, logprobs: 1, echo: true` and sums `token_logprobs` over
the continuation, comparing each with the position's `top_logprobs` to tell whether it is greedy.

The shape is OpenAI's legacy one, over prompt + completion: `tokens`, `token_logprobs` (the first token
has none: null), `top_logprobs` (null at the first token, else a dict token -> log-prob) and
`text_offset` (each token's start in the echoed text). Prompt log-probs are at temperature 1, like those
of greedy output tokens, so a prompt token that is the argmax has exactly its position's top value.
"""

from __future__ import annotations

from typing import Any

from relax.engine_api.openai.backend import Choice, OpenAIBackend
from relax.engine_api.openai.errors import OpenAIError
from relax.engine_api.openai.replies import completion_logprobs

# (log-prob of each prompt token, None for the first; its top (log-prob, token id)s, None for the first)
PromptScores = tuple[list[float | None], list[list[tuple[float, int]] | None]]


async def score_prompt(backend: OpenAIBackend, prompt_ids: list[int], top_n: int) -> PromptScores:
    """The prompt's log-probs from the backend's `prompt_logprobs` (the embedded engine has it; a backend
    without it, such as an agent's session, refuses `echo`)."""
    score = getattr(backend, "prompt_logprobs", None)
    if score is None:
        raise OpenAIError("echo (prompt log-probs) is not served here", 400, "echo")
    return await score(prompt_ids, top_n)


def _token(tokenizer: Any, t: int) -> str:
    return tokenizer.decode([t]) if tokenizer is not None else str(t)


def echoed_choice(
    prompt_ids: list[int], prompt_text: str, scores: PromptScores | None, choice: Choice, tokenizer: Any
) -> tuple[str, dict[str, Any] | None]:
    """(text, logprobs) of one choice with its prompt echoed; `scores` None: no log-probs were asked."""
    text = prompt_text + choice.text
    if scores is None:
        return text, None
    lps, tops = scores
    tokens = [_token(tokenizer, t) for t in prompt_ids]
    offsets, pos = [], 0
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top: list[dict[str, float] | None] = [
        None if k == 0 else {_token(tokenizer, i): v for v, i in (tops[k] if k < len(tops) else None) or []}
        for k in range(len(prompt_ids))
    ]
    out = completion_logprobs(choice.output_ids, choice.logprobs, choice.top_logprobs, tokenizer, pos)
    return text, {
        "tokens": tokens + out["tokens"],
        "token_logprobs": list(lps) + out["token_logprobs"],
        "top_logprobs": top + out["top_logprobs"],
        "text_offset": offsets + out["text_offset"],
    }
