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

from relax.utils.errors import cause_of

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


def latest_checkpoint(run_dir: Path, log: bool = False) -> tuple[int, Path] | None:
    """The newest complete checkpoint; with `log`, says which newer folders it skipped and why."""
    found = complete_checkpoints(run_dir)
    if log:
        newest = found[-1][0] if found else -1
        root = checkpoint_root(run_dir)
        for d in sorted(root.glob("step_*")) if root.is_dir() else []:
            step = d.name.removeprefix("step_")
            if step.isdigit() and int(step) > newest and not (d / MARKER).exists():
                logger.warning(
                    "checkpoint %s is skipped: it has no %s marker (a save that did not finish)", d, MARKER
                )
    return found[-1] if found else None


def resume_point(run_dir: Path, resume: bool) -> tuple[int, Path] | None:
    """The checkpoint a run starts from (None: step 0), creating the run folder; a folder that holds
    checkpoints must be resumed (`FileExistsError` otherwise)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    found = latest_checkpoint(run_dir, log=True) if resume else None
    if resume and found is None:
        logger.warning("--resume: no complete checkpoint in %s; starting from step 0", run_dir)
    if not resume and latest_checkpoint(run_dir) is not None:
        raise FileExistsError(
            f"{run_dir} already holds checkpoints; pass --resume to continue that run, "
            "or choose another run.name / run.output_dir"
        )
    return found


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded (truncated, tampered with, from another model); names the
    folder and what to do."""


def load_failure(d: Path, error: BaseException, run_dir: Path) -> CheckpointError:
    """The error for a checkpoint `d` that failed to load with `error`, naming the earlier complete ones."""
    earlier = [
        p for s, p in complete_checkpoints(run_dir) if p != d and s < int(d.name.removeprefix("step_"))
    ]
    hint = (
        f"move {d} aside and resume from the previous complete checkpoint {earlier[-1]}"
        if earlier
        else "no earlier complete checkpoint exists: start the run again without --resume"
    )
    cause = cause_of(error)  # a role's error arrives as Ray's traceback: its last line is the cause
    return CheckpointError(
        f"checkpoint {d} cannot be loaded ({cause}); its files may be truncated or tampered with. {hint}"
    )


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
