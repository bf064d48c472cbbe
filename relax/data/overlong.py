"""Prompts longer than `data.max_prompt_len`, found when the data is loaded, before training starts.

`data.overlong_prompts` says what happens to them: `drop` (train without them, counted in the
`data/dropped_overlong` metric and warned about with their file and line) or `error` (refuse the data,
naming the first such row). A running run never meets one: the check runs on the driver before Ray
starts (`relax.orchestration.preflight`) and again where the rows are loaded for rollout and eval.

Tokenizing every prompt of a large data set before the start would be slow, so each row is first given
a cheap upper bound on its token count and only rows whose bound passes the limit are tokenized. The
bound rests on this: no tokenizer makes more tokens of a text than the text has UTF-8 bytes (byte-level
BPE encodes each byte at most once, SentencePiece's byte fallback one token per byte at most), plus a
few it may add (a BOS token, a prefix space). The chat template's own text is measured once, with an
empty user message, and counted once per message of the row; a message's contents are bounded by the
bytes of its JSON, which hold every field a template could render.

Rows with media are left alone: their length includes the media tokens, known only once the media are
processed, and such a row that is too long is refused then, naming its file and line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relax.data.dataset import DataError, PromptRow, load_prompt_files, tokenize_prompt

if TYPE_CHECKING:
    from relax.data.config import DataConfig

logger = logging.getLogger(__name__)

DROPPED_METRIC = "data/dropped_overlong"
_EXTRA_TOKENS = 8  # tokens a tokenizer may add beyond one per byte (BOS, a SentencePiece prefix space)
_EXAMPLES = 3  # rows named in the warning or error


@dataclass
class Overlong:
    """A prompt row whose tokenized prompt is longer than `data.max_prompt_len`."""

    row: PromptRow
    tokens: int  # its prompt's length in tokens, chat template included


def find_overlong(rows: list[PromptRow], tokenizer: Any, data: DataConfig) -> list[Overlong]:
    """The text rows of `rows` whose prompt has more than `data.max_prompt_len` tokens, in row order.
    Only rows whose byte bound exceeds the limit are tokenized."""
    overhead = _template_overhead(tokenizer, data)
    found = []
    for row in rows:
        if row.media:
            continue
        if overhead is not None and _token_bound(row, data, overhead) <= data.max_prompt_len:
            continue
        try:
            ids = tokenize_prompt(
                tokenizer, row.prompt, data.apply_chat_template, data.system_prompt, data.chat_template_kwargs
            )
        except ValueError as e:
            raise DataError(f"{row.where or f'row {row.index}'}: {e}") from None
        if len(ids) > data.max_prompt_len:
            found.append(Overlong(row, len(ids)))
    return found


def apply_overlong_policy(
    rows: list[PromptRow], tokenizer: Any, data: DataConfig, key: str
) -> tuple[list[PromptRow], list[Overlong]]:
    """`rows` without their overlong prompts, and those prompts. With `data.overlong_prompts: error`, or
    when no row is left, raise `DataError` naming the first overlong rows and the keys to change. `key`
    names the rows' config key in messages (`data.train_files`, `eval.sets[NAME]`)."""
    found = find_overlong(rows, tokenizer, data)
    if not found:
        return rows, []
    limit = f"data.max_prompt_len={data.max_prompt_len} tokens"
    if data.overlong_prompts == "error":
        raise DataError(
            f"{key}: {len(found)} of {len(rows)} prompt(s) are longer than {limit}: {_examples(found)}. "
            "Shorten or remove them, raise data.max_prompt_len, or set data.overlong_prompts=drop to "
            "train without them"
        )
    dropped = {id(o.row) for o in found}
    kept = [r for r in rows if id(r) not in dropped]
    if not kept:
        raise DataError(
            f"{key}: every prompt ({len(rows)}) is longer than {limit}, so none is left to train on: "
            f"{_examples(found)}. Raise data.max_prompt_len or shorten the prompts"
        )
    return kept, found


def dropped_message(found: list[Overlong], total: int, data: DataConfig, key: str) -> str:
    """The warning for rows dropped by `apply_overlong_policy`: how many, and the first few by file and line."""
    return (
        f"{key}: dropped {len(found)} of {total} prompt(s) longer than data.max_prompt_len="
        f"{data.max_prompt_len} tokens (data.overlong_prompts=drop; counted in {DROPPED_METRIC}): "
        f"{_examples(found)}"
    )


def load_checked(
    files: list[str], data: DataConfig, tokenizer: Any, key: str
) -> tuple[list[PromptRow], list[Overlong]]:
    """`load_prompt_files` with `data.overlong_prompts` applied: the rows to use and those dropped."""
    return apply_overlong_policy(load_prompt_files(files, data), tokenizer, data, key)


def _examples(found: list[Overlong]) -> str:
    named = [f"{o.row.where or f'row {o.row.index}'} ({o.tokens} tokens)" for o in found[:_EXAMPLES]]
    more = f" and {len(found) - _EXAMPLES} more" if len(found) > _EXAMPLES else ""
    return ", ".join(named) + more


def _template_overhead(tokenizer: Any, data: DataConfig) -> int | None:
    """Bytes the chat template writes around one empty user message (system prompt and generation prompt
    included); None if the template cannot be rendered so (then every row is tokenized)."""
    if not data.apply_chat_template:
        return 0
    messages = [{"role": "user", "content": ""}]
    if data.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": data.system_prompt})
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **data.chat_template_kwargs
        )
    except Exception:  # templates raise their own error types (jinja2, ValueError) for odd inputs
        return None
    return len(text.encode())


def _token_bound(row: PromptRow, data: DataConfig, overhead: int) -> int:
    """An upper bound on the row's prompt tokens (see the module docstring)."""
    if isinstance(row.prompt, str):
        body, n_messages = len(row.prompt.encode()), 1
    else:
        body = sum(len(json.dumps(m, ensure_ascii=False).encode()) for m in row.prompt)
        n_messages = len(row.prompt)
    return overhead * n_messages + body + _EXTRA_TOKENS
