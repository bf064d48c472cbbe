"""Global restart bookkeeping (relax/orchestration/recovery.py), without a cluster: the restart count and
its limit, resuming after a restart, and the role named when a replica dies mid-call."""

from __future__ import annotations

import pytest
from ray.exceptions import RayActorError

from relax.orchestration.health import GlobalRestart
from relax.orchestration.recovery import RestartLimitError, run_with_restarts


class _Notes:
    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def failure(self, what: str, exc: BaseException) -> None:
        self.sent.append(("failure", what))

    def restart(self, what: str, detail: str) -> None:
        self.sent.append(("restart", detail))


def _dead_replica(app: str) -> RayActorError:
    return RayActorError(error_msg=f"The actor died unexpectedly. class_name: ServeReplica:{app}:{app}")


def test_a_dead_replica_names_its_role_and_the_run_resumes(tmp_path):
    calls: list[bool] = []

    def attempt(resume: bool) -> int:
        calls.append(resume)
        if len(calls) == 1:
            raise _dead_replica("actor")
        return 7

    notes = _Notes()
    assert run_with_restarts(attempt, resume=False, run_dir=tmp_path, max_restarts=2, notifier=notes) == 7
    assert calls == [False, True]  # the second attempt resumes from the checkpoint
    assert ("failure", "role actor") in notes.sent
    assert any("global restart 1 of 2" in d and "step 0 (no checkpoint yet)" in d for k, d in notes.sent)


def test_the_restart_limit_stops_the_run_saying_how_to_continue(tmp_path):
    def attempt(resume: bool) -> int:
        raise GlobalRestart("rollout", "engines gone")

    with pytest.raises(RestartLimitError, match=r"ops\.max_global_restarts=1.*--resume"):
        run_with_restarts(attempt, resume=False, run_dir=tmp_path, max_restarts=1, notifier=_Notes())
