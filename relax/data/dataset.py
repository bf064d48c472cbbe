"""Prompt data sets: loading `.jsonl` / `.parquet` rows, tokenizing prompts, and a resumable prompt stream.

A row holds either `messages` (a list of {role, content} dicts) or `prompt` (a string), an optional
`label` (any JSON value, handed to the reward) and an optional `metadata` dict. The key names are
configurable. A malformed row raises `DataError`, naming the file, the 1-based row and the field.

Multimodal rows put `<image>`, `<video>`, `<audio>` placeholders in the message text and list the media
per kind under configurable keys (`media_keys={"image": "images", ...}`): file paths (resolved against
the data file's folder), `file://` URLs or base64 data; see `relax.data.media`.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax.data.config import DataConfig

logger = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")
_TOY_HINT = "generate the arithmetic toy set with `python -c \"from relax.data.toy import generate_arith; generate_arith('PATH')\"`"


class DataError(ValueError):
    """A prompt data file is missing, unreadable or holds a malformed row; the message says how to fix it."""


@dataclass
class PromptRow:
    """One prompt of the data set, before tokenization."""

    index: int  # 0-based position of the row in its data set (the files in order): unique, a cache key
    prompt: str | list[dict[str, Any]]  # text, or chat messages [{role, content}, ...]
    label: Any = None  # reference answer for the reward (any JSON value)
    metadata: dict[str, Any] = field(default_factory=dict)  # free-form row metadata
    media: dict[str, list[str]] = field(
        default_factory=dict
    )  # kind -> media references, in placeholder order
    where: str = field(default="", compare=False)  # "line N of FILE": names the row in error messages


def load_prompts(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    label_key: str = "label",
    metadata_key: str = "metadata",
    media_keys: dict[str, str] | None = None,
) -> list[PromptRow]:
    """Read every row of a `.jsonl` or `.parquet` prompt file; raise `DataError` on the first bad row.

    `media_keys` maps a media kind (image, video, audio) to the row field listing that kind's media."""
    path = Path(path)
    if path.suffix not in SUPPORTED_EXTENSIONS:
        raise DataError(
            f"{path}: unsupported file extension {path.suffix!r}; use one of {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    if not path.is_file():
        raise DataError(_missing_message(path))
    records = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
    if not records:
        raise DataError(f"{path} holds no rows; add at least one row with {messages_key!r} or {prompt_key!r}")
    keys = (prompt_key, messages_key, label_key, metadata_key)
    rows = [_parse_row(rec, i, f"{where} of {path}", *keys) for i, (where, rec) in enumerate(records)]
    if media_keys:
        for row, (_, rec) in zip(rows, records, strict=True):
            row.media = _parse_media(rec, row.where, media_keys, path.parent)
    logger.info("loaded %d prompts from %s", len(rows), path)
    return rows


def load_prompt_files(files: list[str], data: DataConfig) -> list[PromptRow]:
    """Rows of several prompt files, read with the key names and media keys of the `data` config; row
    indices run on across the files, so each row's is unique."""
    rows: list[PromptRow] = []
    for f in files:
        start = len(rows)
        rows += load_prompts(
            f,
            prompt_key=data.prompt_key,
            messages_key=data.messages_key,
            label_key=data.label_key,
            metadata_key=data.metadata_key,
            media_keys=data.media.keys(),
        )
        for row in rows[start:]:
            row.index += start
    return rows


def _missing_message(path: Path) -> str:
    parent = path.parent
    if parent.is_dir():
        nearby = sorted(p.name for p in parent.iterdir() if p.suffix in SUPPORTED_EXTENSIONS)[:10]
        where = (
            f"data files in {parent}: {', '.join(nearby)}"
            if nearby
            else f"{parent} has no .jsonl/.parquet files"
        )
    else:
        where = f"the folder {parent} does not exist"
    return f"prompt data file {path} not found ({where}); fix the path, or {_TOY_HINT.replace('PATH', str(path))}"


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    """("line N", parsed value) for every non-blank line; N is 1-based."""
    records = []
    # utf-8-sig: files saved by Windows tools (and pandas' to_json with that encoding) start with a
    # byte-order mark, which json.loads refuses; plain UTF-8 files read the same.
    with path.open(encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"line {lineno} of {path}: invalid JSON ({e.msg} at column {e.colno}); "
                    "each line must be one JSON object"
                ) from None
    return records


def _read_parquet(path: Path) -> list[tuple[str, Any]]:
    """("row N", row dict) for every row; N is 1-based."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read as parquet ({e}); rewrite it with pyarrow or pandas") from e
    return [(f"row {i}", rec) for i, rec in enumerate(table.to_pylist(), start=1)]


def _parse_row(
    rec: Any,
    index: int,
    where: str,
    prompt_key: str,
    messages_key: str,
    label_key: str,
    metadata_key: str,
) -> PromptRow:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: must be a JSON object, got {type(rec).__name__}")
    messages, prompt = rec.get(messages_key), rec.get(prompt_key)
    if messages is not None:
        _check_messages(messages, where, messages_key)
        value: str | list[dict[str, Any]] = messages
    elif prompt is not None:
        if not isinstance(prompt, str):
            raise DataError(f"{where}: field {prompt_key!r} must be a string, got {type(prompt).__name__}")
        value = prompt
    else:
        raise DataError(
            f"{where}: needs a field {messages_key!r} (list of {{role, content}} dicts) or {prompt_key!r} "
            f"(string); found fields {sorted(rec)} (set prompt_key/messages_key if yours are named differently)"
        )
    metadata = rec.get(metadata_key)
    if metadata is None:
        metadata = {}
    elif not isinstance(metadata, dict):
        raise DataError(f"{where}: field {metadata_key!r} must be a dict, got {type(metadata).__name__}")
    return PromptRow(index=index, prompt=value, label=rec.get(label_key), metadata=metadata, where=where)


def _parse_media(rec: dict, where: str, media_keys: dict[str, str], base_dir: Path) -> dict[str, list[str]]:
    """The row's media references per kind, paths made absolute; a missing file is an error here."""
    from relax.data.media import MEDIA_KINDS, resolve_ref

    media: dict[str, list[str]] = {}
    for kind, key in media_keys.items():
        if kind not in MEDIA_KINDS:
            raise DataError(f"unknown media kind {kind!r} in media_keys; use {', '.join(MEDIA_KINDS)}")
        refs = rec.get(key)
        if refs is None:
            continue
        refs = [refs] if isinstance(refs, str) else refs
        if not isinstance(refs, list):
            raise DataError(
                f"{where}: field {key!r} must be a list of {kind} references, got {type(refs).__name__}"
            )
        if refs:
            media[kind] = [resolve_ref(r, base_dir, f"{where}: {kind} {j}", kind) for j, r in enumerate(refs)]
    return media


def _check_messages(messages: Any, where: str, key: str) -> None:
    hint = f"field {key!r} must be a list of {{role, content}} dicts"
    if not isinstance(messages, list) or not messages:
        got = type(messages).__name__ if not isinstance(messages, list) else "an empty list"
        raise DataError(f"{where}: {hint}, got {got}")
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or "content" not in msg:
            raise DataError(f"{where}: {hint}; message {j} is {msg!r}")


def tokenize_prompt(
    tokenizer: Any,
    prompt: str | list[dict[str, Any]],
    apply_chat_template: bool = True,
    system_prompt: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt token ids. With the chat template, a string becomes one user message, `system_prompt` (if
    given and the messages have none) is put first, and the assistant turn is opened
    (`add_generation_prompt=True`); `template_kwargs` are the template's own variables
    (`data.chat_template_kwargs`, e.g. `enable_thinking`). Without it, a string is encoded as is (no
    special tokens added)."""
    if not apply_chat_template:
        if not isinstance(prompt, str):
            raise ValueError("a messages prompt needs apply_chat_template=True")
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and (not messages or messages[0].get("role") != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


class PromptSource:
    """Rows served in epochs, reshuffled each epoch by (seed, epoch); resumable from (epoch, position)."""

    def __init__(self, rows: list[PromptRow], *, shuffle: bool = True, seed: int = 0) -> None:
        if not rows:
            raise DataError("PromptSource needs at least one row")
        self.rows = rows
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0  # epochs completed so far
        self.position = 0  # rows of the current epoch already served
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[PromptRow]:
        """The next `n` rows, crossing into the next epoch (and its new order) when one runs out."""
        batch = []
        for _ in range(n):
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self.rows[self._order[self.position]])
            self.position += 1
        return batch

    def __iter__(self) -> PromptSource:
        return self

    def __next__(self) -> PromptRow:
        return self.next_batch(1)[0]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; the data set and seed must match the saved run."""
        if (
            state.get("num_rows", len(self.rows)) != len(self.rows)
            or state.get("seed", self.seed) != self.seed
        ):
            raise DataError(
                f"cannot resume prompts: saved state has {state.get('num_rows')} rows and seed {state.get('seed')}, "
                f"this source has {len(self.rows)} rows and seed {self.seed}; use the same data file and seed"
            )
        if not 0 <= int(state["position"]) <= len(self.rows):
            raise DataError(
                f"cannot resume prompts: position {state['position']} is outside 0..{len(self.rows)}"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)
