"""Models named by their Hugging Face Hub id (`model.path: Qwen/Qwen2.5-0.5B-Instruct`), as verl and TRL
users write them.

A Hub id is resolved once, on the driver, to one commit (`model.revision` pins a branch, tag or commit;
none means the repository's default branch) and to the snapshot folder of that commit in the Hub cache
(`HF_HOME`, `HF_HUB_CACHE`). The config then names the folder, and `config.yaml` records the commit, so
every role, every node and a resume load the same files, even if the branch moves meanwhile. A node of a
cluster without that snapshot in its own cache fetches exactly that commit before the run starts
(`ensure_snapshot`, called by the per-node path check).

`HF_HUB_OFFLINE=1` is honoured by `huggingface_hub` itself: the cache alone answers, and an id that is not
in it is an error naming the id and the variable.

Data set repositories (`repo_type="dataset"`, `datasets--org--name` in the cache) resolve through the same
`resolve_repo`; `relax.data.hub_data` turns their snapshot into a prompt file on the driver.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# `org/name` as the Hub spells repository ids; a local path is tried first, so `runs/x` that exists
# stays a folder.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# A snapshot folder of the Hub cache: `.../models--org--name/snapshots/<commit>` (`datasets--` for data sets)
_SNAPSHOT = re.compile(
    r"(?P<kind>models|datasets)--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$"
)
# what the Hub calls each kind of repository, in messages
_KIND = {"model": "model", "dataset": "data set"}


class HubError(RuntimeError):
    """A Hub id that cannot be resolved; names the id, the revision and what to do."""


def looks_like_hub_id(value: str, base: Path | None = None) -> bool:
    """`org/name`, not an existing local path (relative to `base`, default the working folder) and not
    written as one (`./x`, `/x`, `~/x`)."""
    if value.startswith((".", "/", "~")) or ((base or Path.cwd()) / Path(value).expanduser()).exists():
        return False
    return bool(_HUB_ID.match(value))


def snapshot_of(path: str, repo_type: str = "model") -> tuple[str, str] | None:
    """(repo id, commit) when `path` is a snapshot folder of the Hub cache of a `repo_type` repository
    ("model" or "dataset"), else None."""
    m = _SNAPSHOT.search(path.replace(os.sep, "/"))
    if m is None or m["kind"] != f"{repo_type}s":
        return None
    return f"{m['org']}/{m['name']}", m["commit"]


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def resolve_model(repo_id: str, revision: str | None = None, key: str = "model.path") -> tuple[str, str]:
    """The local snapshot folder and the commit of `repo_id` at `revision` (fetched into the Hub cache
    unless it is there already, or only from the cache when `HF_HUB_OFFLINE=1`)."""
    return resolve_repo(repo_id, revision, key, "model")


def resolve_repo(
    repo_id: str,
    revision: str | None = None,
    key: str = "model.path",
    repo_type: str = "model",
    allow_patterns: list[str] | None = None,
) -> tuple[str, str]:
    """`resolve_model` for a repository of any type ("model" or "dataset"); `key` names where the
    config names it, for the error messages; `allow_patterns` (huggingface_hub's) fetches only the files
    that match (None: all)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    kind = _KIND[repo_type]
    at = f" at revision {revision!r}" if revision else ""
    flag = "" if repo_type == "model" else f" --repo-type {repo_type}"
    try:
        folder = snapshot_download(
            repo_id, revision=revision, repo_type=repo_type, allow_patterns=allow_patterns
        )
    except IncompleteSnapshotError as e:  # before its base class: the cache holds part of the files
        raise HubError(f"{key} = {repo_id}{at}: {e} (HF_HOME, HF_HUB_OFFLINE)") from e
    except LocalEntryNotFoundError as e:
        where = (
            "HF_HUB_OFFLINE=1 is set, and the Hub cache"
            if _offline()
            else "the Hub cannot be reached and its cache"
        )
        raise HubError(
            f"{key} = {repo_id}{at}: {where} ({_cache_dir()}) does not hold this {kind}. Download it first "
            f"(`hf download{flag} {repo_id}`) on a machine with network access and point HF_HOME at that "
            f"cache, or give a local {'model folder' if repo_type == 'model' else 'data file'}."
        ) from e
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise HubError(
            f"{key} = {repo_id}: no such {kind} on the Hub, or it needs a login (`hf auth login` or "
            f"HF_TOKEN); a local {'folder' if repo_type == 'model' else 'file'} needs a path that exists."
        ) from e
    except RevisionNotFoundError as e:
        where = " (model.revision)" if repo_type == "model" else ""
        raise HubError(f"{key} = {repo_id}: revision {revision!r} does not exist{where}") from e
    found = snapshot_of(folder, repo_type)
    commit = found[1] if found else (revision or "")
    return folder, commit


def ensure_snapshot(path: str) -> None:
    """On a node: fetch the Hub snapshot `path` names (its exact commit) if this node's cache lacks it.
    A no-op for other paths and for snapshots present; errors are left to the path check that follows."""
    found = snapshot_of(path)
    if found is None or Path(path).is_dir():
        return
    try:
        resolve_model(found[0], found[1])
    except HubError:
        pass  # the path check reports the missing folder, naming the node


def _cache_dir() -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    return str(HF_HUB_CACHE)
