"""Fault injection on a real local Ray cluster: processes are killed mid-run (SIGKILL) and the run must
recover as the HealthManager promises. Each killer waits on a condition of the run (lines in
metrics.jsonl, a heartbeat from a new replica), never on a fixed sleep."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable

import httpx
import pytest
import ray
from inbox import Inbox

from relax.config import load_config
from relax.ops.heartbeat import get_board
from relax.orchestration import checkpoint as ckpt
from relax.orchestration.controller import Controller
from relax.orchestration.recovery import RestartLimitError
from relax.utils import faults
from relax.utils.auth import auth_headers, read_run_token
from tests.faults.fake_engine import REFUSAL, FakeEngine
from tests.faults.harness import metric_rows, run_overrides, steps_logged, wait_for

pytestmark = pytest.mark.slow


def fault_config(tiny_model_dir, arith_file, out_dir, name, notify_url, *extra):
    return load_config(
        "tests/toy_arith.yaml",
        [
            *run_overrides(tiny_model_dir, arith_file, out_dir, name),
            f"ops.notify_urls=[{notify_url}]",
            "schedule.data_plane=ray",
            *extra,
        ],
    )


def rows(cfg) -> list[dict]:
    return metric_rows(cfg.run.run_dir)


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
        wait_for(lambda: len(steps_logged(cfg.run.run_dir)) >= 1, "step 1")
        kill(wait_for(lambda: beat_pid("engine/0"), "engine/0 heartbeat"))
        killed.append("engine/0")
        wait_for(lambda: len(steps_logged(cfg.run.run_dir)) >= 3, "step 3")
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


def test_the_only_engine_killed_mid_rollout_and_mid_push_is_replaced(
    ray_cluster, tiny_model_dir, arith_file, tmp_path, inbox, fault_dir
):
    """colocate with one engine (the quickstart's shape): the engine is killed while a rollout request
    is about to reach it, then again just before a weight push. Requests wait for the replacement, which
    gets the current weights at once; the run finishes every step on exactly its samples."""
    cfg = fault_config(tiny_model_dir, arith_file, tmp_path, "only_engine", inbox.url, "trainer.num_steps=6")
    killed: list[tuple[str, int]] = []

    def kill_at(point: str) -> None:
        before = [pid for _, pid in killed]
        faults.wait_reached(fault_dir, point)
        try:
            pid = wait_for(lambda: (p := beat_pid("engine/0")) not in before and p, "engine/0 heartbeat")
            kill(pid)
            killed.append((point, pid))
        finally:
            faults.release(fault_dir, point)

    def plan() -> None:
        kill_at("router.request")  # mid-rollout of step 1: the request goes to the dead engine
        faults.hold(fault_dir, "weight_push.push", at=2)  # a later push: its group holds the dead engine
        kill_at("weight_push.push")

    faults.hold(fault_dir, "router.request")  # the first request of the run
    killer = Killer(plan)
    killer.start()
    assert Controller(cfg).run() == 6
    killer.join(timeout=60)
    assert killer.error is None and [p for p, _ in killed] == ["router.request", "weight_push.push"], (
        killer.error,
        killed,
    )
    out = rows(cfg)
    assert [r["step"] for r in out] == [1, 2, 3, 4, 5, 6]
    assert [r["rollout/num_samples"] for r in out] == [32.0] * 6  # none lost, none counted twice
    # colocate is on-policy: a sample from a replacement without the current weights would show here
    assert max(r["rollout/staleness_max"] for r in out) == 0, [r["rollout/staleness_max"] for r in out]
    assert [r["weight_version"] for r in out] == [1, 2, 3, 4, 5, 6]
    assert out[-1]["health/engine_restarts"] == 2.0
    got = titles(inbox)
    assert got.count("restart: engine") == 2 and "restart: global" not in got, got
    assert got[-1] == "run finished", got


def test_an_elastic_scale_out_to_an_engine_that_refuses_the_weight_group_fails_alone(
    ray_cluster, tiny_model_dir, arith_file, tmp_path, inbox, fault_dir
):
    """`external` scale-out to an engine that answers /health but refuses /init_weights_update_group:
    the operation fails naming the refusal, the group is formed again without it (the real engine is
    not left in a half-done rendezvous), and the run finishes every step."""
    cfg = fault_config(
        tiny_model_dir, arith_file, tmp_path, "elastic_refused", inbox.url, "trainer.num_steps=6"
    )
    seen: dict[str, object] = {}

    def plan(fake: FakeEngine) -> None:
        faults.wait_reached(fault_dir, "weight_push.push")  # the run holds at a push
        try:
            endpoints = cfg.run.run_dir / "endpoints.json"
            url = wait_for(
                lambda: endpoints.exists() and json.loads(endpoints.read_text()).get("elastic_api"), "API"
            )
            http = httpx.Client(
                base_url=url, timeout=60, headers=auth_headers(read_run_token(cfg.run.run_dir))
            )
            r = http.post("/v1/engines/scale_out", json={"mode": "external", "engine_urls": [fake.url]})
            assert r.status_code == 202, r.text
            op_id = r.json()["request_id"]
            # it waits for the next push to join the group
            wait_for(lambda: http.get(f"/v1/operations/{op_id}").json()["state"] == "weight_syncing", "join")
        finally:
            faults.release(fault_dir, "weight_push.push")
        seen["op"] = wait_for(
            lambda: (o := http.get(f"/v1/operations/{op_id}").json())["done"] and o, "the op"
        )
        seen["engines"] = [e["url"] for e in http.get("/v1/engines").json()["engines"]]

    faults.hold(fault_dir, "weight_push.push", at=2)  # the push after step 1
    with FakeEngine() as fake:
        killer = Killer(lambda: plan(fake))
        killer.start()
        assert Controller(cfg).run() == 6
        killer.join(timeout=60)
    assert killer.error is None, killer.error
    op = seen["op"]
    assert op["state"] == "failed" and REFUSAL in op["error"], op
    assert fake.url not in seen["engines"], seen["engines"]
    assert "/init_weights_update_group" in fake.paths()
    out = rows(cfg)
    assert [r["step"] for r in out] == [1, 2, 3, 4, 5, 6]
    assert [r["weight_version"] for r in out] == [1, 2, 3, 4, 5, 6]
    assert "restart: global" not in titles(inbox)


def test_a_full_disk_at_a_checkpoint_stops_the_run_naming_the_cause_and_file(
    ray_cluster, shared_engine, tiny_model_dir, arith_file, tmp_path, inbox
):
    """The checkpoints live on a small tmpfs, filled once checkpoint 2 is complete: the save of checkpoint
    4 fails, and the run stops with an error that says `No space left on device` and names the file
    (not Ray's `ObjectRefStreamEndOfStreamError`); checkpoint 2 is intact and readable."""
    cfg = fault_config(
        tiny_model_dir,
        arith_file,
        tmp_path,
        "full_disk",
        inbox.url,
        "trainer.num_steps=8",
        "ops.checkpoint_interval=2",
        *shared_engine.overrides(),  # the session's engine server (tests/conftest.py)
    )
    root = ckpt.checkpoint_root(cfg.run.run_dir)
    root.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "relax-full-disk", str(root)], check=True)
    try:

        def plan() -> None:
            wait_for(lambda: ckpt.latest_checkpoint(cfg.run.run_dir), "checkpoint 2")
            free = shutil.disk_usage(root).free
            with open(root / "filler", "wb") as f:  # leaves far less than a checkpoint needs
                os.posix_fallocate(f.fileno(), 0, free - (64 << 10))

        killer = Killer(plan)
        killer.start()
        with pytest.raises(Exception, match="No space left on device") as raised:
            Controller(cfg).run()
        killer.join(timeout=60)
        assert killer.error is None, killer.error
        message = str(raised.value)
        assert str(ckpt.step_dir(cfg.run.run_dir, 4)) in message and ".distcp" in message, message
        step, path = ckpt.latest_checkpoint(cfg.run.run_dir)
        assert step == 2
        from torch.distributed.checkpoint import FileSystemReader

        assert FileSystemReader(str(path / "actor" / "dcp")).read_metadata().state_dict_metadata
        assert json.loads((path / "actor" / "trainer.json").read_text())["step"] == 2
        assert json.loads((path / "rollout.json").read_text())["source"]
        assert [r["step"] for r in rows(cfg)] == [1, 2, 3, 4]
        assert titles(inbox)[-1] == "failure: the run stopped"
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


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
        wait_for(lambda: len(steps_logged(cfg.run.run_dir)) >= 3, "step 3")  # checkpoint 2 is complete
        first = beat_pid("actor")
        kill(first)
        seen["first"] = first
        seen["checkpoint"] = ckpt.latest_checkpoint(cfg.run.run_dir)[0]
        # the restarted run redoes the steps after the checkpoint with the same numbers
        wait_for(lambda: steps_logged(cfg.run.run_dir, "metrics.superseded.jsonl"), "the set-aside steps")
        wait_for(
            lambda: len(steps_logged(cfg.run.run_dir)) >= seen["checkpoint"] + 2, "steps after the restart"
        )
        seen["after_restart"] = steps_logged(cfg.run.run_dir)
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
    assert steps_logged(cfg.run.run_dir, "metrics.superseded.jsonl")[0] == c + 1
    # the replay: each step once, in order, on exactly its samples, and a redone step draws the prompts
    # the set-aside one drew (the checkpoint's data position: none skipped, none drawn twice)
    out = rows(cfg)
    assert [r["step"] for r in out] == list(range(1, len(out) + 1))
    assert all(r["rollout/num_samples"] == 32.0 for r in out), [r["rollout/num_samples"] for r in out]
    redone = {r["step"]: r for r in out}
    for old in metric_rows(cfg.run.run_dir, "metrics.superseded.jsonl"):
        if old["step"] in redone:
            got = redone[old["step"]]["rollout/prompt_len_mean"]
            assert got == pytest.approx(old["rollout/prompt_len_mean"]), (old["step"], got)
    got = titles(inbox)
    assert got.count("restart: global") == 1, got
    assert got[-1] == "failure: the run stopped"
    assert "max_global_restarts" in inbox.bodies[-1]["message"]
