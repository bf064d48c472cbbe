"""Checkpoint folders of a run: `<run_dir>/checkpoints/step_<k>/` with a `COMPLETE` marker written last.

A checkpoint is usable only once `COMPLETE` exists, so a run killed mid-save never resumes from a torn
folder: `latest_checkpoint` skips it. Old checkpoints beyond `keep` are removed only after a newer one is
complete.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        if d.name.startswith("step_") and (d / MARKER).exists():
            found.append((int(d.name.removeprefix("step_")), d))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def begin(run_dir: Path, step: int) -> Path:
    d = step_dir(run_dir, step)
    if d.exists():  # an incomplete earlier attempt at this step
        shutil.rmtree(d)
    d.mkdir(parents=True)
    return d


def finish(run_dir: Path, step: int, meta: dict, keep: int) -> Path:
    d = step_dir(run_dir, step)
    (d / "meta.json").write_text(json.dumps({"step": step, "time": time.time(), **meta}, indent=2))
    (d / MARKER).write_text("")
    for old_step, old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
        logger.info("removed old checkpoint step %d", old_step)
    return d
