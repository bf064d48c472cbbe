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
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# `org/name` as the Hub spells repository ids; a local path is tried first, so `runs/x` that exists
# stays a folder.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
# A snapshot folder of the Hub cache: `.../models--org--name/snapshots/<commit>`
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")


class HubError(RuntimeError):
    """A Hub id that cannot be resolved; names the id, the revision and what to do."""


def looks_like_hub_id(value: str, base: Path | None = None) -> bool:
    """`org/name`, not an existing local path (relative to `base`, default the working folder) and not
    written as one (`./x`, `/x`, `~/x`)."""
    if value.startswith((".", "/", "~")) or ((base or Path.cwd()) / Path(value).expanduser()).exists():
        return False
    return bool(_HUB_ID.match(value))


def snapshot_of(path: str) -> tuple[str, str] | None:
    """(repo id, commit) when `path` is a snapshot folder of the Hub cache, else None."""
    m = _SNAPSHOT.search(path.replace(os.sep, "/"))
    return None if m is None else (f"{m['org']}/{m['name']}", m["commit"])


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def resolve_model(repo_id: str, revision: str | None = None, key: str = "model.path") -> tuple[str, str]:
    """The local snapshot folder and the commit of `repo_id` at `revision` (fetched into the Hub cache
    unless it is there already, or only from the cache when `HF_HUB_OFFLINE=1`)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    try:
        folder = snapshot_download(repo_id, revision=revision)
    except LocalEntryNotFoundError as e:
        where = (
            "HF_HUB_OFFLINE=1 is set, and the Hub cache"
            if _offline()
            else "the Hub cannot be reached and its cache"
        )
        raise HubError(
            f"{key} = {repo_id}{at}: {where} ({_cache_dir()}) does not hold it. Download it first "
            "(`huggingface-cli download " + repo_id + "`) on a machine with network access and point HF_HOME "
            "at that cache, or give a local model folder."
        ) from e
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise HubError(
            f"{key} = {repo_id}: no such model on the Hub, or it needs a login (`huggingface-cli login` or "
            "HF_TOKEN); a local folder needs a path that exists."
        ) from e
    except RevisionNotFoundError as e:
        raise HubError(f"{key} = {repo_id}: revision {revision!r} does not exist (model.revision)") from e
    found = snapshot_of(folder)
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
