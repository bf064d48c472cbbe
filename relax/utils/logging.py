"""Logging set-up for the command line and for the processes of a run: one format, INFO by default,
quiet third-party loggers.

In a role's process (a Ray actor) of a cluster Relax started with a run's log folder (`RELAX_LOG_DIR`,
relax/orchestration/service.py), Relax's INFO lines go to `<log folder>/<process>-<pid>.log` and only
warnings and errors to the console (the process's real stderr, which Ray forwards to the driver): the
console shows the driver's progress, and a role that fails still shows its cause there."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("RELAX_LOG_LEVEL", "INFO")).upper()
    log_dir = os.environ.get("RELAX_LOG_DIR")
    role = bool(log_dir) and _in_ray_actor()
    if role:
        _setup_role_logging(level, Path(log_dir))
    else:
        logging.basicConfig(level=level, format=FORMAT, datefmt=DATEFMT)
    from relax.utils.redact import RedactingFilter

    for handler in logging.getLogger().handlers:  # secrets never reach a log (relax/utils/redact.py)
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    for noisy in ("httpx", "httpcore", "urllib3", "filelock", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if not role:  # in a role, Serve's logger writes to its file only, with what the replica prints
        logging.getLogger("ray.serve").setLevel(logging.WARNING)


def _in_ray_actor() -> bool:
    """Whether this process is a Ray actor (a role, an engine, a training rank), not a driver."""
    if "ray" not in sys.modules:
        return False
    import ray

    try:
        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - no runtime context: not a Ray worker
        return False


def _setup_role_logging(level: str, log_dir: Path) -> None:
    root = logging.getLogger()
    if any(getattr(h, "_relax_role", False) for h in root.handlers):
        return  # a second role class in the same process
    log_dir.mkdir(parents=True, exist_ok=True)
    formatter = logging.Formatter(FORMAT, DATEFMT)
    # the real stderr: Serve (RAY_SERVE_LOG_TO_STDERR=0) points sys.stderr of a replica at its log file
    console = logging.StreamHandler(sys.__stderr__)
    console.setLevel(logging.WARNING)
    to_file = logging.FileHandler(log_dir / f"{_process_name()}-{os.getpid()}.log")
    to_file.setLevel(level)
    for handler in (console, to_file):
        handler.setFormatter(formatter)
        handler._relax_role = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
    # Python warnings (libraries' deprecations) go to the file only: the console is for Relax's own
    logging.captureWarnings(True)
    py_warnings = logging.getLogger("py.warnings")
    py_warnings.propagate = False
    py_warnings.addHandler(to_file)
    # transformers' "Loading weights" bars would reach the console through the actor's stderr
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _process_name() -> str:
    """Ray's title of this process (`ray::ServeReplica:rollout:rollout` -> `ServeReplica_rollout_rollout`)."""
    try:
        title = Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        title = ""
    title = title.removeprefix("ray::").split(".")[0].split(" ")[0]
    return re.sub(r"[^A-Za-z0-9_-]+", "_", title).strip("_") or "worker"
