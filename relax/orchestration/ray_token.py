"""Ray's own token authentication on the clusters Relax starts itself.

Loopback is no boundary on a shared machine: any local process that reaches an unauthenticated Ray
cluster can `ray.init(address=...)`, run code as the run's owner and read the run's secrets. So a local
cluster Relax starts runs with `RAY_AUTH_MODE=token` and a token of the run's own, kept readable by its
owner only in `<run_dir>/secrets/ray_token` (a fresh one per run; `--resume` reuses the file). Ray reads
it through `RAY_AUTH_TOKEN_PATH`, which every Ray process started from this one inherits (GCS, raylet,
workers), so the token is never in an environment, a command line, a log or `config.yaml`. A process
without it is refused by the GCS (`ray.exceptions.AuthenticationError`).

The user's environment wins: `RAY_AUTH_MODE=disabled` (loudly) or a token of their own
(`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`). A cluster Relax joins is never touched: its auth is the
cluster's (docs/cluster.md).
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

MODE_ENV, TOKEN_ENV, PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
TOKEN_FILE = "ray_token"
_ours: str | None = None  # the RAY_AUTH_TOKEN_PATH this module set (a later run may replace it)


def enable_ray_token(secrets_dir: Path | str | None) -> Path | None:
    """Before Relax starts a local cluster: token authentication on, with the token in
    `secrets_dir/ray_token` (created 0600, or reused), or, without a run folder (a test session, a
    benchmark), in a private temporary folder removed at exit. Returns the token file, or None when the
    user's environment decides (auth disabled, or a token of theirs)."""
    global _ours
    if _ray_running():  # a cluster already up in this process keeps the token it started with
        return None
    mode = os.environ.get(MODE_ENV)
    if mode is not None and mode.lower() != "token":
        logger.warning(
            "%s=%s in the environment: the local Ray cluster starts WITHOUT token authentication; any "
            "process on this machine can join it and run code as you",
            MODE_ENV,
            mode,
        )
        return None
    given = os.environ.get(PATH_ENV)
    if os.environ.get(TOKEN_ENV) or (given and given != _ours):
        if not os.environ.get(TOKEN_ENV) and not _readable(given):  # Ray would abort the process on it
            raise RuntimeError(
                f"{PATH_ENV}={given} cannot be read (Ray's token for the local cluster): fix or unset it; "
                "unset, Relax makes a token of the run's own"
            )
        os.environ[MODE_ENV] = "token"
        _refresh_ray()
        return None
    path = _token_file(secrets_dir)
    os.environ[MODE_ENV], os.environ[PATH_ENV] = "token", str(path)
    _ours = str(path)
    _refresh_ray()
    logger.info("Ray token authentication on; the token is in %s (owner only)", path)
    return path


def _token_file(secrets_dir: Path | str | None) -> Path:
    from relax.utils.redact import register_secret, write_secret_file

    if secrets_dir is None:
        secrets_dir = tempfile.mkdtemp(prefix="relax-ray-")  # mode 0700
        # registered before ray.init registers its own shutdown, so it runs after Ray has stopped
        atexit.register(shutil.rmtree, secrets_dir, ignore_errors=True)
    path = Path(secrets_dir) / TOKEN_FILE
    try:
        token = path.read_text().strip()  # --resume: the run keeps its token
    except OSError:
        token = ""
    # Ray's own format (ray get-auth-token --generate): 256 random bits, hex
    token = token or secrets.token_hex(32)
    write_secret_file(path, token)  # 0600 again, even for a reused file
    register_secret(token)  # masked in this process's logs, should it ever reach one
    return path


def _readable(path: str) -> bool:
    try:
        return bool(Path(path).read_text().strip())
    except OSError:
        return False


def _ray_running() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _refresh_ray() -> None:
    """Make this process's Ray see the new settings: Ray caches its config and the token it loaded (as
    Ray's own tests do between clusters); nothing to do before Ray is first used."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config
    except ImportError:  # an older Ray without token authentication: it ignores the variables
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
