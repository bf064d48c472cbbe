"""SIGTERM while the roles start, and during a step stuck in its update, stops `relax train`; a stalled
step fails the run naming the role and the phase. Ctrl-C on `relax train` (finishing the step, leaving a
checkpoint, nothing left running) is checked on the run tests/e2e/test_security_e2e.py reads as an
attacker, and on the simulated cluster (tests/cluster/test_multi_host.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faults.places import HOOK_DIR, marked_pids

pytestmark = pytest.mark.slow


TOKEN = f"relax-interrupt-{uuid.uuid4().hex}"  # marks every process the run starts (Ray inherits env)
# the stuck and stalled updates hang whatever they train on: step 1's rollout as small as it goes
SMALL_STEP = ("rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4")


def _train(args, log, **extra_env: str):
    env = {**os.environ, "RELAX_LOG_LEVEL": "INFO", "RELAX_TEST_TOKEN": TOKEN, **extra_env}
    cmd = [sys.executable, "-m", "relax.entrypoints.cli", "train", *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _run_pids() -> set[int]:
    """Live processes started by the training run (other Ray clusters on the machine do not count)."""
    return marked_pids(TOKEN)


def _args(tmp_path, tiny_model_dir, arith_file, name: str, *extra: str) -> list[str]:
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("{}\n")
    return [
        str(cfg_file),
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{arith_file}]",
        f"run.output_dir={tmp_path}",
        f"run.name={name}",
        "ops.progress=false",
        *extra,
    ]


def _sigterm_once(args: list[str], log_file: Path, ready: Callable[[], bool], **extra_env: str) -> str:
    """Start the run, wait until `ready()`, send one SIGTERM to the driver; the exit must be code 130.
    Returns the log. How fast it stops is not asserted here (a loaded machine stretches every phase):
    the log must name the phase the stop came in."""
    with open(log_file, "w") as log:
        proc = _train(args, log, **extra_env)
        deadline = time.monotonic() + 480
        while time.monotonic() < deadline and proc.poll() is None and not ready():
            time.sleep(0.1)
        assert proc.poll() is None and ready(), log_file.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)  # to the driver, as a scheduler or `kill` sends it
        try:  # generous: a hang fails the test instead of blocking it
            assert proc.wait(timeout=300) == 130, log_file.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    return log_file.read_text()


def _nothing_left_running() -> None:
    deadline = time.monotonic() + 30
    while _run_pids() and time.monotonic() < deadline:
        time.sleep(1)
    assert not _run_pids(), "processes of the run (Ray, engines) left behind after SIGTERM"


def test_sigterm_while_roles_start_ends_the_run(tiny_model_dir, arith_file, tmp_path):
    """A stop asked for before any step ran (roles still deploying) ends the run at once, with nothing
    left running; it no longer waits for a step that never starts."""
    log_file = tmp_path / "log.txt"
    args = _args(tmp_path, tiny_model_dir, arith_file, "early")
    text = _sigterm_once(args, log_file, lambda: "starting roles" in log_file.read_text())
    assert "stop requested while roles" in text, text[-3000:]
    # the replicas end with the cluster the run started, not after Serve's graceful stop of each
    assert "the run stops: its roles end with the Ray cluster it started" in text, text[-3000:]
    metrics = tmp_path / "early" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step ran
    _nothing_left_running()


def test_sigterm_during_a_stuck_step_stops_after_the_grace(tiny_model_dir, arith_file, tmp_path):
    """The Actor hangs in its update (a 10-minute sleep); one SIGTERM stops the run once
    ops.stop_grace_s is over, with nothing left running."""
    log_file = tmp_path / "log.txt"
    args = _args(
        tmp_path,
        tiny_model_dir,
        arith_file,
        "stuck",
        "ops.stop_grace_s=5",
        "schedule.debug_train_delay_s=600",
        "schedule.data_plane=ray",  # spares TransferQueue's actors: not the subject (docs/testing.md)
        *SMALL_STEP,
    )
    # once step 1's update has started (it sleeps 600 s: only the grace ends it), whatever the load; the
    # fault suite's phase hook (tests/faults/hook) marks the Actor's train_sync call in `fault_dir/hit`
    fault_dir = tmp_path / "fault"
    fault_dir.mkdir()
    (fault_dir / "arm").write_text(json.dumps({"phase": "update", "hold_s": 0}))
    path = os.pathsep.join([str(HOOK_DIR), str(Path.cwd()), os.environ.get("PYTHONPATH", "")])
    text = _sigterm_once(
        args,
        log_file,
        lambda: (fault_dir / "hit").exists(),
        RELAX_FAULT_DIR=str(fault_dir),
        PYTHONPATH=path.rstrip(os.pathsep),
    )
    assert "did not finish the update of step 1 within ops.stop_grace_s=5s" in text, text[-3000:]
    _nothing_left_running()


def test_a_stalled_step_fails_the_run_naming_role_and_phase(
    ray_cluster, shared_engine, tiny_model_dir, arith_file, tmp_path
):
    from relax.config import load_config
    from relax.orchestration.controller import Controller
    from relax.orchestration.watchdog import StepStalled

    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            "run.name=stall",
            "ops.progress=false",
            "ops.step_timeout_s=8",
            "ops.max_global_restarts=0",
            "schedule.debug_train_delay_s=600",
            "schedule.data_plane=ray",  # spares TransferQueue's actors: not the subject (docs/testing.md)
            *SMALL_STEP,
            *shared_engine.overrides(),  # the session's engine server (tests/conftest.py)
        ],
    )
    # the update sleeps 600 s: a watchdog that did not fire would let the step finish, and nothing be raised
    with pytest.raises(StepStalled, match="step 1 stalled: actor did not finish the update within"):
        Controller(cfg).run()
