"""Logging set-up for the command line: one format, INFO by default, quiet third-party loggers."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None) -> None:
    level = level or os.environ.get("RELAX_LOG_LEVEL", "INFO")
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    from relax.utils.redact import RedactingFilter

    for handler in logging.getLogger().handlers:  # secrets never reach a log (relax/utils/redact.py)
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    for noisy in ("httpx", "httpcore", "urllib3", "filelock", "ray.serve", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
