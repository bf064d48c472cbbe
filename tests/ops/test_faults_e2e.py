"""Fault injection on a real local Ray cluster: processes are killed mid-run (SIGKILL) and the run must
recover as the HealthManager promises. Each killer waits on a condition of the run (lines in
metrics.jsonl, a heartbeat from a new replica), never on a fixed sleep."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest
import ray
from inbox import Inbox

from relax.config import load_config
from relax.ops.heartbeat import get_board
from relax.orchestration import checkpoint as ckpt
from relax.orchestration.controller import Controller
from relax.orchestration.recovery import RestartLimitError

pytestmark = pytest.mark.slow

WAIT_S = 300.0  # generous: the machine may be loaded


def fault_config(tiny_model_dir, arith_file, out_dir, name, notify_url, *extra):
    return load_config(
        "tests/toy_arith.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={out_dir}",
            f"run.name={name}",
            "rollout.prompts_per_step=8",
            "rollout.n_samples_per_prompt=4",
            "rollout.engine_threads=1",
            "trainer.threads=1",
            "ops.progress=false",
            "ops.tensorboard=false",
            "ops.heartbeat_interval_s=0.5",
            "ops.heartbeat_timeout_s=15",
            f"ops.notify_urls=[{notify_url}]",
            "eval.sets=[]",
            "eval.before_train=false",
            "schedule.data_plane=ray",
            *extra,
        ],
    )


def steps_logged(cfg, name: str = "metrics.jsonl") -> list[int]:
    path = cfg.run.run_dir / name
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def rows(cfg) -> list[dict]:
    return [json.loads(line) for line in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_for(cond: Callable[[], object], what: str) -> object:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(f"waited {WAIT_S:.0f}s for {what}")


def beat_pid(name: str) -> int | None:
    board = get_board()
    if board is None:
        return None
    beat = ray.get(board.snapshot.remote()).get(name)
    return beat["pid"] if beat is not None and beat["age_s"] < 5 else None


class Killer(threading.Thread):
    """Runs `plan` beside the training run; its exception fails the test."""

    def __init__(self, plan: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.plan, self.error = plan, None

    def run(self) -> None:
        try:
            self.plan()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def inbox():
    box = Inbox()
    yield box
    box.close()


def titles(inbox) -> list[str]:
    return [b["title"].split("] ", 1)[1] for b in inbox.bodies]


def test_engine_and_actor_fwd_killed_are_replaced_in_place(
    ray_cluster, tiny_model_dir, arith_file, tmp_path, inbox
):
    """fully_async with two engines: an engine is killed after step 1, the ActorFwd replica after step 3;
    the run finishes all steps without a global restart."""
    cfg = fault_config(
        tiny_model_dir,
        arith_file,
        tmp_path,
        "in_place",
        inbox.url,
        "schedule.mode=fully_async",
        "schedule.max_staleness=1",
        "rollout.num_engines=2",
        "trainer.num_steps=5",
    )
    killed = []

    def plan() -> None:
        wait_for(lambda: len(steps_logged(cfg)) >= 1, "step 1")
        kill(wait_for(lambda: beat_pid("engine/0"), "engine/0 heartbeat"))
        killed.append("engine/0")
        wait_for(lambda: len(steps_logged(cfg)) >= 3, "step 3")
        kill(wait_for(lambda: beat_pid("actor_fwd"), "actor_fwd heartbeat"))
        killed.append("actor_fwd")

    killer = Killer(plan)
    killer.start()
    assert Controller(cfg).run() == 5
    killer.join(timeout=60)
    assert killer.error is None and killed == ["engine/0", "actor_fwd"], (killer.error, killed)
    out = rows(cfg)
    assert [r["step"] for r in out] == [1, 2, 3, 4, 5]
    # every step trained on exactly prompts_per_step x n samples: none lost, none counted twice
    assert [r["rollout/num_samples"] for r in out] == [32.0] * 5
    # a sample from an engine without the current weights (version 0) would break the staleness bound
    assert max(r["rollout/staleness_max"] for r in out) <= 1, [r["rollout/staleness_max"] for r in out]
    assert max(r["staleness/max"] for r in out) <= 1
    assert out[-1]["health/engine_restarts"] == 1.0
    assert out[-1]["health/role_restarts"] >= 1.0
    got = titles(inbox)
    assert "restart: engine" in got and "restart: actor_fwd" in got, got
    assert "restart: global" not in got and got[-1] == "run finished", got
    assert not (cfg.run.run_dir / "metrics.superseded.jsonl").exists()


def test_actor_killed_global_restart_then_restart_cap(
    ray_cluster, tiny_model_dir, arith_file, tmp_path, inbox
):
    cfg = fault_config(
        tiny_model_dir,
        arith_file,
        tmp_path,
        "actor",
        inbox.url,
        "trainer.num_steps=8",
        "ops.checkpoint_interval=2",
        "ops.max_global_restarts=1",
    )
    seen: dict[str, object] = {}

    def plan() -> None:
        wait_for(lambda: len(steps_logged(cfg)) >= 3, "step 3")  # checkpoint 2 is complete
        first = beat_pid("actor")
        kill(first)
        seen["first"] = first
        seen["checkpoint"] = ckpt.latest_checkpoint(cfg.run.run_dir)[0]
        # the restarted run redoes the steps after the checkpoint with the same numbers
        wait_for(lambda: steps_logged(cfg, "metrics.superseded.jsonl"), "the set-aside steps")
        wait_for(lambda: len(steps_logged(cfg)) >= seen["checkpoint"] + 2, "steps after the restart")
        seen["after_restart"] = steps_logged(cfg)
        second = wait_for(lambda: (p := beat_pid("actor")) != first and p, "the new Actor")
        kill(second)

    killer = Killer(plan)
    killer.start()
    with pytest.raises(RestartLimitError, match="max_global_restarts=1"):
        Controller(cfg).run()
    killer.join(timeout=60)
    assert killer.error is None, killer.error
    c = seen["checkpoint"]
    assert c == 2
    after = seen["after_restart"]
    assert after[: c + 2] == list(range(1, c + 3)), after  # 1..c kept, c+1.. redone, same numbering
    assert steps_logged(cfg, "metrics.superseded.jsonl")[0] == c + 1
    got = titles(inbox)
    assert got.count("restart: global") == 1, got
    assert got[-1] == "failure: the run stopped"
    assert "max_global_restarts" in inbox.bodies[-1]["message"]
