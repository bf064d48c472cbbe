"""The cause of an error in one line, for messages that name it.

An error raised in a role reaches the driver as Ray's `RayTaskError`, whose text is the remote traceback
(colour codes included); its last line is the remote error itself (`RuntimeError: ...`). Messages that
quote a cause use that line, so the console and the elastic API show the reason, not a traceback.
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def cause_of(error: BaseException) -> str:
    """`Type: message` of `error`, or of the remote error a Ray task error carries."""
    text = _ANSI.sub("", str(error)).strip()
    if type(error).__name__.startswith("RayTaskError") or "Traceback (most recent call last)" in text:
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1].strip() if lines else type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
