"""OpenAI request -> the engine's sampling parameters (SGLang names), with the output constraints:

* `response_format`: `json_object` -> any JSON object, `json_schema` -> that schema (`json_schema` of the
  engine); `text` -> none.
* `tool_choice` with `tools`: `auto` (the default) parses the model's tool calls from its text; `none`
  parses none; `required` and a named function constrain the output with a grammar of Qwen's tool-call
  format, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (one or more calls of any of
  the tools, or exactly one call of the named one), whose arguments follow each tool's JSON schema. The
  grammar is Lark (llguidance's dialect, sent as the engine's `ebnf`), so the tokens are the model's own
  format and train like any other turn.
"""

from __future__ import annotations

import json
from typing import Any

from relax.engine_api.openai.errors import OpenAIError
from relax.engine_api.openai.schema import ChatCompletionRequest, Sampling
from relax.engine_api.openai.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

CONSTRAINTS = ("regex", "ebnf", "json_schema")


def sampling_params(req: Sampling, max_new_tokens: int | None) -> dict[str, Any]:
    """The SGLang sampling parameters a request sets (unset ones are left to the backend's defaults)."""
    params: dict[str, Any] = {
        "n": req.n,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
    }
    if max_new_tokens is not None:
        params["max_new_tokens"] = max_new_tokens
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        *CONSTRAINTS,
    ):
        value = getattr(req, name)
        if value is not None:
            params[name] = value
    if req.seed is not None:
        params["sampling_seed"] = req.seed
    if req.min_tokens:
        params["min_new_tokens"] = req.min_tokens
    if isinstance(params.get("json_schema"), dict):
        params["json_schema"] = json.dumps(params["json_schema"])
    return params


def _constrain(params: dict[str, Any], kind: str, value: str, why: str) -> None:
    if any(params.get(k) is not None for k in CONSTRAINTS):
        raise OpenAIError(f"{why} cannot be combined with regex, ebnf or json_schema", 400, why)
    params[kind] = value


def apply_response_format(params: dict[str, Any], response_format: dict[str, Any] | None) -> None:
    if not response_format:
        return
    kind = response_format.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        _constrain(params, "json_schema", json.dumps({"type": "object"}), "response_format")
    elif kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema", {"type": "object"}) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise OpenAIError(
                "response_format.json_schema.schema must be a JSON schema object", 400, "response_format"
            )
        _constrain(params, "json_schema", json.dumps(schema), "response_format")
    else:
        raise OpenAIError(
            f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
            400,
            "response_format",
        )


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not fn.get("name"):
            raise OpenAIError(
                'every tool must be {"type": "function", "function": {"name": ..., ...}}', 400, "tools"
            )
        out[fn["name"]] = fn
    return out


def tag_term(tokenizer: Any, tag: str) -> str:
    """A Lark term for a tag: the token itself (`<[id]>`) when the tokenizer has it as one added token
    (Qwen's `<tool_call>`: llguidance matches such tokens by id, never by their text), else the text."""
    if tokenizer is not None:
        tid = tokenizer.convert_tokens_to_ids(tag)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tokenizer.decode([tid]) == tag:
            return f"<[{tid}]>"
    return json.dumps(tag)


def tool_grammar(functions: list[dict[str, Any]], many: bool, tokenizer: Any = None) -> str:
    """A Lark grammar of Qwen tool calls of these functions (`many`: one or more, else exactly one)."""
    alternatives = [
        {
            "type": "object",
            "properties": {
                "name": {"const": fn["name"]},
                "arguments": fn.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for fn in functions
    ]
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    # fixed separators, no free whitespace (see the engine's `grammar.JSON_OPTIONS`): the call always ends
    schema = {
        **schema,
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    }
    start = 'start: call ("\\n" call)*' if many else "start: call"
    call = f'{tag_term(tokenizer, TOOL_CALL_OPEN)} "\\n" body "\\n" {tag_term(tokenizer, TOOL_CALL_CLOSE)}'
    return f"{start}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"


def apply_tools(params: dict[str, Any], req: ChatCompletionRequest, tokenizer: Any = None) -> bool:
    """Check `tools` and `tool_choice`, constrain the output where the choice forces a call; returns
    whether tool calls are parsed from the output."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise OpenAIError("tool_choice needs tools", 400, "tool_choice")
        return False
    functions = _functions(req.tools)
    if choice == "none":
        return False
    if choice in (None, "auto"):
        return True
    if choice == "required":
        _constrain(
            params,
            "ebnf",
            tool_grammar(list(functions.values()), many=True, tokenizer=tokenizer),
            "tool_choice",
        )
        return True
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if name not in functions:
        raise OpenAIError(
            f"tool_choice names function {name!r}, which is not among the tools {sorted(functions)}",
            400,
            "tool_choice",
        )
    _constrain(
        params, "ebnf", tool_grammar([functions[name]], many=False, tokenizer=tokenizer), "tool_choice"
    )
    return True
