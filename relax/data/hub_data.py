"""Prompt data named by a Hugging Face Hub data set, as TRL users name theirs (`dataset_name`,
`dataset_config`, `dataset_train_split`), written where a data file goes (`data.train_files`,
`eval.sets[].files`):

    hf://datasets/openai/gsm8k?config=main&split=train&prompt=question&label=answer
    hf://openai/gsm8k@<branch, tag or commit>?config=main        (the short form; `revision=` works too)

`hf://datasets/<org>/<name>[@revision]` is the spelling of `huggingface_hub`'s HfFileSystem, pandas,
Polars and DuckDB; `config` and `split` are the `datasets` config name and split (default split: `train`
for training data, `test` for eval sets); `prompt`, `messages`, `label` and `metadata` name the data
set's columns that play those parts (they become the `data.*_key` fields of each row; other columns are
kept as they are).

On the driver, before Ray starts, the repository is resolved through `relax.utils.hub` (one commit, the
Hub cache of `HF_HOME` / `HF_HUB_CACHE`, `HF_HUB_OFFLINE=1` honoured; only the card and the chosen
config's files when the card's `configs:` name them) and the split is read from that
snapshot by the `datasets` library (its README `configs:` metadata, parquet / JSON / CSV files) and
written once as a JSONL prompt file into the run folder,
`<run_dir>/data/<org>--<name>--<config>--<split>--<digest>.jsonl`. The config then names that file, so
the row checks, the overlong-prompt policy and every role read it as any local file, on every node, and
line N of the file is row N of the split: each error names the data set and the row. The digest covers
the commit, config, split and column mapping: a file is never rewritten with other rows, and a run
started again with the same source reuses it. `<file>.source.json` beside it records the source.

Only what `datasets` reads without running code is read (no loading scripts: `datasets` 5 has none).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

from relax.data.dataset import DataError

if TYPE_CHECKING:
    from relax.data.config import DataConfig

logger = logging.getLogger(__name__)

HUB_PREFIX = "hf://"
# the parts a column may play -> the DataConfig field naming that part in a row
COLUMN_ROLES = {
    "prompt": "prompt_key",
    "messages": "messages_key",
    "label": "label_key",
    "metadata": "metadata_key",
}
_PARAMS = ("config", "split", "revision", *COLUMN_ROLES)
_README = "README.md"
_FORM = "hf://datasets/<org>/<name>[@revision]?config=<config>&split=<split>[&prompt=<column>&label=<column>]"


@dataclass(frozen=True)
class HubDataset:
    """One Hub data set split, as a config entry names it."""

    spec: str  # the entry as written, for messages
    repo_id: str  # `org/name`
    split: str  # the `datasets` split
    config: str | None = None  # the `datasets` config name; None = the data set's only (or default) one
    revision: str | None = None  # branch, tag or commit; None = the default branch
    columns: dict[str, str] = field(default_factory=dict)  # part (prompt, label, ...) -> data set column


def is_hub_dataset(entry: str) -> bool:
    """Whether a data entry of the config names a Hub data set rather than a local file."""
    return entry.startswith(HUB_PREFIX)


def parse_hub_dataset(spec: str, default_split: str, key: str) -> HubDataset:
    """The data set an `hf://` entry names; `DataError` (naming `key` and the entry) when it is malformed."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    def bad(why: str) -> DataError:
        return DataError(f"{key} = {spec}: {why}; write it as {_FORM}")

    path, _, query = spec[len(HUB_PREFIX) :].partition("?")
    parts = path.strip("/").split("/")
    if len(parts) == 3 and parts[0] == "datasets":  # HfFileSystem's spelling: the repository type first
        parts = parts[1:]
    if len(parts) != 2:
        raise bad("a data set is named `<org>/<name>` (a file inside it cannot be named)")
    name, _, at_revision = parts[1].partition("@")
    repo_id = f"{parts[0]}/{name}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise bad(f"{repo_id!r} is not a Hub repository id ({e})") from None
    params: dict[str, str] = {}
    for k, v in parse_qsl(query, keep_blank_values=True):
        if k not in _PARAMS:
            raise bad(f"unknown parameter {k!r} (known: {', '.join(_PARAMS)})")
        if k in params:
            raise bad(f"parameter {k!r} given twice")
        if not v:
            raise bad(f"parameter {k!r} is empty")
        params[k] = v
    if at_revision and "revision" in params:
        raise bad("the revision is given twice (`@` and `revision=`)")
    columns = {role: params[role] for role in COLUMN_ROLES if role in params}
    if len(set(columns.values())) < len(columns):
        raise bad(f"one column plays two parts ({columns})")
    return HubDataset(
        spec=spec,
        repo_id=repo_id,
        split=params.get("split", default_split),
        config=params.get("config"),
        revision=at_revision or params.get("revision"),
        columns=columns,
    )


def materialize(ds: HubDataset, data: DataConfig, out_dir: Path, key: str) -> Path:
    """The JSONL prompt file of `ds` under `out_dir`, written from the Hub snapshot of one commit unless
    it is there already. Raises `HubError` when the repository cannot be resolved (offline and not
    cached, no such data set, no such revision) and `DataError` when the split cannot be read."""
    folder, commit = _fetch(ds, key)
    mapping = {getattr(data, COLUMN_ROLES[role]): column for role, column in ds.columns.items()}
    source = {
        "dataset": ds.repo_id,
        "commit": commit,
        "config": ds.config,
        "split": ds.split,
        "columns": mapping,  # row field -> data set column
    }
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()[:10]
    org, name = ds.repo_id.split("/")
    parts = [
        re.sub(r"[^A-Za-z0-9_.-]", "_", part) for part in (ds.config or "default", ds.split)
    ]  # a file name
    path = out_dir / f"{org}--{name}--{parts[0]}--{parts[1]}--{digest}.jsonl"
    sidecar = path.with_suffix(".source.json")
    if path.is_file() and sidecar.is_file():  # the sidecar is written last: the file is complete
        logger.info("%s = %s: commit %s, already in %s", key, ds.spec, commit, path)
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    where = f"{key} = {ds.spec} (commit {commit})"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    n = 0
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            for n, rec in enumerate(_split_rows(folder, ds, where), start=1):
                fh.write(_json_line(_map_columns(rec, mapping, f"row {n} of {where}"), f"row {n} of {where}"))
        if n == 0:
            raise DataError(f"{where}: split {ds.split!r} holds no rows")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    sidecar.write_text(json.dumps({**source, "spec": ds.spec, "rows": n}, indent=1) + "\n")
    logger.info("%s = %s: commit %s, %d rows written to %s", key, ds.spec, commit, n, path)
    return path


def _fetch(ds: HubDataset, key: str) -> tuple[str, str]:
    """The snapshot folder and commit of the data set, holding its README and the files of the chosen
    config only when the README's `configs:` say which they are (other configs of a repository may be
    far larger), else every file."""
    from relax.utils.hub import resolve_repo

    folder, commit = resolve_repo(ds.repo_id, ds.revision, key, "dataset", allow_patterns=[_README])
    patterns = config_patterns(Path(folder) / _README, ds.config)
    allow = None if patterns is None else [_README, *patterns]
    return resolve_repo(ds.repo_id, commit or ds.revision, key, "dataset", allow_patterns=allow)


def config_patterns(readme: Path, config: str | None) -> list[str] | None:
    """The file patterns of `config` (None: the default config) in a data set card's `configs:`, every
    split's (`datasets` resolves them all), as `huggingface_hub` matches them (fnmatch, where `*` also
    crosses `/`); [] for a config the card does not list (`datasets` then names those it does); None
    when the card does not say (no card, no `configs:`, a form not handled here): fetch everything."""
    from huggingface_hub import DatasetCard

    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    if not text.startswith("---"):  # no metadata block (DatasetCard would warn of it)
        return None
    try:
        configs = DatasetCard(text).data.to_dict().get("configs")
    except Exception:  # noqa: BLE001 - a card it cannot parse: `datasets` will say what is wrong
        return None
    if not isinstance(configs, list) or not all(isinstance(c, dict) for c in configs):
        return None
    if config is not None:
        chosen = next((c for c in configs if c.get("config_name", "default") == config), None)
    else:  # as `datasets` picks: the one marked default, the only one, or the one named default
        marked = [c for c in configs if c.get("default")]
        named = [c for c in configs if c.get("config_name", "default") == "default"]
        chosen = (marked or (configs if len(configs) == 1 else named) or [None])[0]
    if chosen is None:
        return []
    files = chosen.get("data_files")
    entries = files if isinstance(files, list) else [files]
    paths: list[str] = []
    for entry in entries:
        value = entry.get("path") if isinstance(entry, dict) else entry
        values = value if isinstance(value, list) else [value]
        if not values or not all(isinstance(v, str) and v and "://" not in v for v in values):
            return None  # no data_files (a data_dir, the conventions) or a URL: let everything come
        paths += values
    out: list[str] = []
    for path in paths:
        path = path.removeprefix("./")
        out += [path, path.replace("**/", "")] if "**/" in path else [path]  # `**/` may match no folder
    return out


def _split_rows(folder: str, ds: HubDataset, where: str) -> Iterator[dict[str, Any]]:
    """The rows of the split, streamed by `datasets` from the snapshot's files (nothing copied into the
    `datasets` cache: its bookkeeping goes to a temporary folder)."""
    import datasets

    with tempfile.TemporaryDirectory(prefix="relax-hub-data-") as cache:
        try:
            stream = datasets.load_dataset(
                folder, name=ds.config, split=ds.split, streaming=True, cache_dir=cache
            )
            yield from stream
        except Exception as e:  # datasets and pyarrow raise ValueError, FileNotFoundError, ArrowInvalid, ...
            msg = " ".join(str(e).split())  # datasets' messages span lines
            raise DataError(
                f"{where}: `datasets` cannot read config {ds.config!r}, split {ds.split!r}: {msg}"
            ) from e


def _map_columns(rec: dict[str, Any], mapping: dict[str, str], where: str) -> dict[str, Any]:
    """The row with the mapped columns renamed to their row fields; the other columns kept."""
    missing = [column for column in mapping.values() if column not in rec]
    if missing:
        raise DataError(
            f"{where}: no column {missing[0]!r}; its columns are {sorted(rec)} (fix the column mapping "
            f"{', '.join(f'{k}={v}' for k, v in mapping.items())})"
        )
    out = {k: v for k, v in rec.items() if k not in mapping.values()}
    out.update({target: rec[column] for target, column in mapping.items()})
    return out


def _json_line(row: dict[str, Any], where: str) -> str:
    try:
        return json.dumps(row, ensure_ascii=False, default=_plain) + "\n"
    except (TypeError, ValueError):
        for column, value in row.items():
            try:
                json.dumps(value, default=_plain)
            except (TypeError, ValueError):
                raise DataError(
                    f"{where}: column {column!r} holds a {type(value).__name__}, which a JSON prompt row cannot "
                    "hold (Hub data sets are read as text rows; images and audio need a local file, "
                    "docs/multimodal.md)"
                ) from None
        raise


def _plain(value: Any) -> Any:
    """JSON for the values parquet holds beyond JSON's own (dates and times as ISO 8601 text)."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    raise TypeError(type(value).__name__)
