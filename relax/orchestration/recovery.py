"""Global restart: when a failure costs state that only a checkpoint restores (the Actor died, or a role
keeps failing; `relax.orchestration.health.GlobalRestart`), every role is stopped and started again and
training resumes from the last complete checkpoint, with the same step numbering (the metrics of steps
after the checkpoint are moved to `metrics.superseded.jsonl` and written again). At most
`ops.max_global_restarts` such restarts; the next failure stops the run with `RestartLimitError`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

from relax.ops.notify import Notifier
from relax.orchestration import checkpoint as ckpt
from relax.orchestration.health import GlobalRestart

logger = logging.getLogger(__name__)

try:
    from ray.exceptions import RayActorError as ReplicaGone  # a role's replica died mid-call
except ImportError:  # pragma: no cover - Ray is a dependency
    ReplicaGone = GlobalRestart


def _role_of(error: BaseException) -> str:
    """The role whose replica died, read from the actor class Ray names (`ServeReplica:<app>:<deployment>`,
    and each role is its own Serve application); "unknown" for any other actor."""
    m = re.search(r"ServeReplica:([\w-]+):", str(error))
    return m.group(1) if m else "unknown"


class RestartLimitError(RuntimeError):
    """The run failed again after `ops.max_global_restarts` global restarts."""


def run_with_restarts(
    attempt: Callable[[bool], int], *, resume: bool, run_dir: Path, max_restarts: int, notifier: Notifier
) -> int:
    """Call `attempt(resume)` until it returns the last step; after a restartable failure call it again
    with `resume=True`, at most `max_restarts` times."""
    restarts = 0
    while True:
        try:
            return attempt(resume)
        except (GlobalRestart, ReplicaGone) as e:
            failure = (
                e if isinstance(e, GlobalRestart) else GlobalRestart(_role_of(e), f"a replica died: {e}")
            )
            found = ckpt.latest_checkpoint(run_dir)
            where = f"checkpoint step {found[0]}" if found else "step 0 (no checkpoint yet)"
            if restarts >= max_restarts:
                raise RestartLimitError(
                    f"{failure} after {restarts} global restart(s), the limit (ops.max_global_restarts="
                    f"{max_restarts}); the run is stopped. Fix the cause, then continue from {where} with "
                    "`relax train CONFIG --resume` (or raise ops.max_global_restarts)"
                ) from e
            restarts += 1
            logger.error("%s; global restart %d of %d from %s", failure, restarts, max_restarts, where)
            notifier.failure(f"role {failure.role}", e)
            notifier.restart(
                "global", f"{failure}; global restart {restarts} of {max_restarts}, resuming from {where}"
            )
            resume = True
