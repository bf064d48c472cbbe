"""Why a write under a folder failed, said so that a user can act on it: a checkpoint writer's own error
often hides the cause (torch's zip writer turns a full disk into `unexpected pos 704 vs 598`; DCP wraps
it per rank), and an error that does not cross Ray's boundary intact loses it altogether.
`write_failure(folder, error)` names the cause (`No space left on device`, with the space left) and the
file being written, as a plain picklable exception."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

PROBE_BYTES = 1 << 20  # written next to the failed file to tell a full filesystem from another failure


class WriteError(RuntimeError):
    """A write under a folder failed; the message names the cause and the file."""


def _errno_in(error: BaseException) -> int | None:
    """The first errno in `error`'s chain (and in DCP's per-rank failures)."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e.errno
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
        todo += [e.__cause__, e.__context__]
    return None


def _full(folder: Path) -> bool:
    """Whether the filesystem of `folder` refuses a small write for lack of space."""
    probe = folder / ".relax-space-probe"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
        return False
    except OSError as e:
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    finally:
        probe.unlink(missing_ok=True)


def write_failure(folder: Path, error: BaseException) -> WriteError:
    """The error to raise when writing under `folder` failed with `error`."""
    folder = Path(folder)
    files = [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []
    file = max(files, key=lambda p: p.stat().st_mtime_ns) if files else folder  # the one written last
    code = _errno_in(error)
    if code is None and folder.is_dir() and _full(folder):
        code = errno.ENOSPC
    cause = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        usage = shutil.disk_usage(folder if folder.exists() else folder.parent)
        return WriteError(
            f"writing {file} failed: [Errno {code}] {os.strerror(code)} ({usage.free} bytes free of "
            f"{usage.total} on its filesystem); free space there or move run.output_dir ({cause})"
        )
    reason = f"[Errno {code}] {os.strerror(code)}" if code else cause
    return WriteError(f"writing {file} failed: {reason}")
