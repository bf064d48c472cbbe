"""Relax on a Ray cluster of four simulated hosts (tests/cluster/netns.py) in the shape Ray recommends: a
head that only coordinates (`--num-cpus=0`, the driver runs there), the roles on host 2 (label tier=cpu),
the engines on hosts 3 and 4 (tier=engine, one `engine_slot` each). Runs use the quickstart's relative
paths from the shared work folder and are started the ways Ray users start jobs: `RAY_ADDRESS` and
`ray job submit`.

- fully_async with RAY_ADDRESS: engines on other hosts serve the Rollout, weights reach them with the
  version advancing every step, an elastic scale-out adds an engine, an engine killed mid-run is replaced,
  Ctrl-C ends the run, and the run folder holds every step's metrics, TensorBoard events, complete
  checkpoints with weights and eval samples; `relax status` reads it.
- colocate through `ray job submit`, then `--resume` with RAY_ADDRESS continues it: every actor (roles,
  engine, TransferQueue's controller and storage unit) lands where its CPUs are, none on the 0-CPU head.
- a run that asks for more than the cluster has stops before any role starts, naming the shortfall and
  the keys to change; two SIGTERMs while the roles start end the process (exit 130).
- a data file one host cannot see stops the run before training, naming the host and the path; a model
  that fails to load stops the run on the constructor's error, naming the node (full tier).

The same checks on unlabelled clusters with a 0-CPU or a 1-CPU head are tests/cluster/test_cluster_shapes.py
and scripts/cluster_soak.py (the full tier).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.netns import SimulatedCluster, netns_unavailable

_unavailable = netns_unavailable()
# slow: scripts/test.sh runs the slow tests one at a time, so one simulated cluster exists at a time
# (each is a network of its own, namespaces and bridge named by its process: two could coexist)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_unavailable is not None, reason=_unavailable or ""),
]

RELAX = [sys.executable, "-m", "relax.entrypoints.cli"]
ROLE_HOST, ROLE_TIER, ENGINE_TIER = "198.18.0.2", {"tier": "cpu"}, {"tier": "engine"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    from relax.data.toy import generate_arith
    from relax.models.tiny import write_tiny_model

    work = tmp_path_factory.mktemp("cluster-work")
    write_tiny_model(work / "assets" / "model", family="qwen2")
    generate_arith(work / "assets" / "arith.jsonl", n=400, seed=0)
    generate_arith(work / "assets" / "arith_eval.jsonl", n=16, seed=1)
    broken = work / "assets" / "broken_model"
    broken.mkdir()  # its tokenizer loads (the driver measures prompts with it); its model does not
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work / "assets" / "model" / f, broken / f)
    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_architecture"}))
    (work / "only_some").mkdir()  # hidden from host 3
    generate_arith(work / "only_some" / "arith.jsonl", n=50, seed=2)
    roles = {"label_selector": ROLE_TIER}
    config = {
        "run": {"name": "cluster", "output_dir": "runs"},
        "model": {"path": "assets/model"},
        "data": {"train_files": ["assets/arith.jsonl"], "apply_chat_template": False},
        "rollout": {"prompts_per_step": 8, "n_samples_per_prompt": 4, "max_new_tokens": 4},
        "reward": {"name": "first_number"},
        "trainer": {"lr": 3e-3},
        "eval": {"sets": [{"name": "arith", "files": ["assets/arith_eval.jsonl"], "max_prompts": 8}]},
        "ops": {"progress": False, "heartbeat_interval_s": 1.0},
        "resources": {
            "placement": {
                **{
                    name: roles
                    for name in ("rollout", "actor", "actor_fwd", "reference", "advantages", "metrics")
                },
                # one engine per engine host: a label picks the hosts, a custom resource counts the slots
                "engines": {"label_selector": ENGINE_TIER, "resources": {"engine_slot": 1}},
            }
        },
    }
    (work / "cluster.yaml").write_text(yaml.safe_dump(config))
    return work


@pytest.fixture(scope="module")
def cluster(workdir):
    with SimulatedCluster(
        workdir,
        cpus=[0, 6, 3, 3],
        labels=[{}, ROLE_TIER, ENGINE_TIER, ENGINE_TIER],
        resources=[{}, {}, {"engine_slot": 1}, {"engine_slot": 1}],
        hidden=[[], [], [workdir / "only_some"], []],
    ) as c:
        yield c


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train(cluster: SimulatedCluster, *overrides: str, resume: bool = False, timeout_s: float = 600):
    argv = [*RELAX, "train", "cluster.yaml", *overrides, *(["--resume"] if resume else [])]
    return cluster.run(1, argv, timeout_s=timeout_s, RAY_ADDRESS=cluster.address)


def ops(cluster: SimulatedCluster, *args: str) -> dict:
    done = cluster.run(1, [sys.executable, "-m", "tests.cluster.ops_client", *args], timeout_s=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def host_of(url: str) -> str:
    return re.match(r"https?://([^:/]+)", url).group(1)


def kill_engine_on(cluster: SimulatedCluster, address: str) -> int:
    """Kill one embedded engine process on the host with `address`; returns its pid."""
    import os
    import subprocess

    host = next(h for h in cluster.hosts if h.address == address)
    for pid in subprocess.run(
        ["ip", "netns", "pids", host.ns], capture_output=True, text=True
    ).stdout.split():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"EngineActor" in cmdline:
            os.kill(int(pid), 9)
            return int(pid)
    raise AssertionError(f"no engine process on {address}")


def test_fully_async_across_hosts_scale_out_and_a_lost_engine(cluster, workdir):
    """The run is ended by Ctrl-C once everything was seen, not by a step count: a scale-out (an engine
    process started on another host) and an engine's replacement take as long as the machine makes
    them, and a run that had reached its last step first closed the elastic API under the operation."""
    run_dir = workdir / "runs" / "fa"
    argv = [
        *RELAX,
        "train",
        "cluster.yaml",
        "run.name=fa",
        "schedule.mode=fully_async",
        "schedule.max_staleness=1",
        "trainer.num_steps=1000",
        "schedule.debug_train_delay_s=1.0",  # paces the steps: the operations share two cores with them
        "ops.checkpoint_interval=5",
        "eval.interval=5",
        "eval.at_end=false",
    ]
    proc = cluster.popen(1, argv, workdir / "fa.log", RAY_ADDRESS=cluster.address)

    def wait_rows(ok, what: str) -> list[dict]:
        deadline = time.monotonic() + 420
        while proc.poll() is None and time.monotonic() < deadline:
            if ok(got := rows(run_dir)):
                return got
            time.sleep(1)
        raise AssertionError(f"{what}: not seen\n" + (workdir / "fa.log").read_text()[-4000:])

    try:
        wait_rows(lambda got: len(got) >= 2, "two steps")
        rollout_host = host_of(json.loads((run_dir / "endpoints.json").read_text())["elastic_api"])
        assert rollout_host == ROLE_HOST  # the elastic API runs in the Rollout, on its node's address

        op = ops(cluster, "scale_out", str(run_dir), "2")
        assert op["state"] == "active", op
        listed = ops(cluster, "engines", str(run_dir))["engines"]
        hosts = {host_of(e["url"]) for e in listed}
        assert len(listed) == 2 and len(hosts) == 2 and rollout_host not in hosts, listed
        assert all(e["healthy"] and e["in_weight_sync_group"] for e in listed), listed

        step_at_kill = len(rows(run_dir))
        kill_engine_on(cluster, host_of(listed[0]["url"]))
        # replaced, then two more steps whose weights reached the engines, and past the first checkpoint
        replaced = wait_rows(
            lambda got: any(r["health/engine_restarts"] >= 1 for r in got), "the lost engine replaced"
        )
        wait_rows(lambda got: len(got) >= max(len(replaced) + 2, 6), "steps after the replacement")
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the step ends, a checkpoint is saved, exit 0
        assert proc.wait(timeout=300) == 0, (workdir / "fa.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    got = rows(run_dir)
    steps = len(got)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["weight_version"] for r in got] == list(range(1, steps + 1))  # every push reached the engines
    assert step_at_kill < steps and got[-1]["health/engine_restarts"] >= 1
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    kept = sorted(int(d.name.split("_")[1]) for d in (run_dir / "checkpoints").glob("step_*"))
    # the interval's and Ctrl-C's checkpoints (ops.keep_checkpoints=2 keeps the last two), each complete
    assert len(kept) == 2 and kept[0] % 5 == 0 and kept[-1] == steps, kept
    for step in kept:
        ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
        assert (ckpt / "COMPLETE").exists() and (ckpt / "actor" / "dcp" / ".metadata").exists()
    assert (run_dir / "eval" / "arith" / "step_000005.jsonl").exists()
    status = cluster.run(1, [*RELAX, "status", "--json", str(run_dir)], timeout_s=120)
    assert status.returncode == 0 and json.loads(status.stdout)["step"] == steps, (
        status.stdout + status.stderr
    )


def test_colocate_by_ray_job_submit_then_resume_with_ray_address(cluster, workdir, request):
    run_dir = workdir / "runs" / "co"
    entry = f"cd {workdir} && {sys.executable} -m relax.entrypoints.cli train cluster.yaml run.name=co trainer.num_steps=3 ops.checkpoint_interval=3 eval.interval=0 eval.at_end=false"
    ray = str(Path(sys.executable).parent / "ray")
    done = cluster.run(
        1, [ray, "job", "submit", f"--address={cluster.dashboard}", "--", "bash", "-c", entry], timeout_s=600
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3], done.stdout[-3000:]
    fits = re.search(r"the run fits the cluster: (.*)", done.stdout)
    assert fits and "198.18.0.1" not in fits.group(1), done.stdout[-3000:]  # nothing on the 0-CPU head
    # TransferQueue's actors started where Ray placed them (TQ's own bootstrap pinned one to the head)
    assert "TransferQueue: controller and 1 storage unit(s) up" in done.stdout
    assert (run_dir / "checkpoints" / "step_000003" / "COMPLETE").exists()
    if not request.config.getoption("--full"):
        return  # the resume is CI's in process (tests/e2e/test_train_e2e.py); here, in the full tier
    again = train(
        cluster, "run.name=co", "trainer.num_steps=5", "eval.interval=0", "eval.at_end=false", resume=True
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4, 5]
    assert rows(run_dir)[-1]["weight_version"] == 5


def test_too_small_a_cluster_and_two_sigterms_at_start_stop_the_run(cluster, workdir):
    # more engines than the engine hosts' slots: stopped before any role starts
    small = train(cluster, "run.name=toomany", "rollout.num_engines=3", timeout_s=300)
    assert small.returncode == 1, small.stderr[-3000:]
    assert "the run does not fit the Ray cluster" in small.stderr
    assert re.search(r"short by \{[^}]*engine_slot: 1", small.stderr), small.stderr[-3000:]
    assert "rollout.num_engines" in small.stderr
    assert "starting roles" not in small.stderr

    # two SIGTERMs while the roles start: the process ends
    log = workdir / "sigterm.log"
    argv = [*RELAX, "train", "cluster.yaml", "run.name=sigterm"]
    proc = cluster.popen(1, argv, log, RAY_ADDRESS=cluster.address)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and "starting roles" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        # generous: a hang fails the test instead of blocking it
        assert proc.wait(timeout=300) == 130, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    # the second SIGTERM met the start (stopping now), the way out (stopped at once), or, when the first
    # had ended the start within the half second, a process already gone: 130 each time
    assert "stop requested while roles" in text or "SIGTERM again" in text, text[-3000:]
    assert not rows(workdir / "runs" / "sigterm")


def test_a_path_one_host_cannot_see_stops_the_run_before_training(cluster, workdir):
    done = train(cluster, "run.name=hidden", "data.train_files=[only_some/arith.jsonl]", timeout_s=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert re.search(
        r"node 198\.18\.0\.3: data\.train_files\[0\] = \S*only_some/arith\.jsonl: no such file", done.stderr
    )
    assert "198.18.0.2" not in done.stderr.split("cannot use the config's paths")[1].split("Every node")[0]
    assert not rows(workdir / "runs" / "hidden")


# full tier: the same stop on a failing constructor, its error and node, is checked on the session's
# cluster (tests/orchestration/test_role_start.py); here it is the CLI's message on a labelled node
@pytest.mark.full
def test_a_role_that_fails_to_start_stops_the_run_on_its_error(cluster, workdir):
    done = train(cluster, "run.name=broken", "model.path=assets/broken_model", timeout_s=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert re.search(r"role \w+ could not start on node 198\.18\.0\.\d: ", done.stderr), done.stderr[-3000:]
    assert "no_such_architecture" in done.stderr
    # stopped by the constructor's error as it happened, not by a start-up deadline that ran out
    assert "not running after" not in done.stderr and "did not start within" not in done.stderr
