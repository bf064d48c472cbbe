"""Clusters as Ray recommends starting them (tests/cluster/netns.py: three simulated hosts), with nothing
labelled: a head that only coordinates (`--num-cpus=0`), or one with a single CPU, and two 4-CPU workers.

- the quickstart trains to its last step with complete checkpoints on both shapes: every actor (roles,
  engine, TransferQueue's controller and storage unit) lands where its CPUs are;
- a run that asks for more than the cluster has stops before any role starts, naming the shortfall and
  the keys to change;
- two SIGTERMs while the roles start end the process (exit 130), whatever the start-up is waiting for.

CI trains on the 0-CPU head (Ray's recommended shape, with the shortfall and SIGTERM checks); the 1-CPU
head is in the full tier (`bash scripts/test.sh --full`, which also runs scripts/cluster_soak.py: the two
shapes ten times in a row).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.cluster.netns import SimulatedCluster, netns_unavailable

_unavailable = netns_unavailable()
# one simulated cluster at a time: with pytest-xdist, every test of the group runs in the same worker
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_unavailable is not None, reason=_unavailable or ""),
    pytest.mark.xdist_group("netns"),
]

RELAX = [sys.executable, "-m", "relax.entrypoints.cli"]
STEPS = 4
# the quickstart, smaller: CI pays for every step on two shared cores
SHORT = [
    f"trainer.num_steps={STEPS}",
    "ops.checkpoint_interval=2",
    "rollout.prompts_per_step=8",
    "eval.interval=0",
    "eval.before_train=false",
    "eval.at_end=false",
    "ops.progress=false",
]


def quickstart_workdir(work: Path) -> Path:
    """The quickstart's config with its assets (a tiny model and the arithmetic data) in `work`."""
    from relax.data.toy import generate_arith
    from relax.models.tiny import write_tiny_model

    write_tiny_model(work / "assets" / "model", family="qwen2")
    generate_arith(work / "assets" / "arith_train.jsonl", n=400, seed=0)
    generate_arith(work / "assets" / "arith_eval.jsonl", n=16, seed=1)
    repo = Path(__file__).resolve().parents[2]
    cfg = yaml.safe_load((repo / "examples" / "quickstart.yaml").read_text())
    cfg["model"]["path"] = "assets/model"
    cfg["data"]["train_files"] = ["assets/arith_train.jsonl"]
    cfg["eval"]["sets"][0]["files"] = ["assets/arith_eval.jsonl"]
    (work / "quickstart.yaml").write_text(yaml.safe_dump(cfg))
    return work


def steps_of(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def complete_checkpoints(run_dir: Path) -> list[int]:
    found = sorted((run_dir / "checkpoints").glob("step_*/COMPLETE"))
    return [int(p.parent.name.split("_")[1]) for p in found if (p.parent / "actor").is_dir()]


def train(cluster: SimulatedCluster, name: str, *overrides: str, timeout_s: float = 600):
    argv = [*RELAX, "train", "quickstart.yaml", f"run.name={name}", *SHORT, *overrides]
    return cluster.run(1, argv, timeout_s=timeout_s, RAY_ADDRESS=cluster.address)


def assert_trained(cluster: SimulatedCluster, name: str) -> None:
    done = train(cluster, name)
    run_dir = cluster.workdir / "runs" / name
    assert done.returncode == 0, done.stderr[-4000:]
    assert steps_of(run_dir) == list(range(1, STEPS + 1))
    assert complete_checkpoints(run_dir) == [2, 4]
    assert "the run fits the cluster" in done.stderr
    # TransferQueue's actors started where Ray placed them (TQ's own bootstrap pinned one to the head)
    assert "TransferQueue: controller and 1 storage unit(s) up" in done.stderr


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return quickstart_workdir(tmp_path_factory.mktemp("shapes-work"))


def test_head_without_cpus(workdir):
    with SimulatedCluster(workdir, cpus=[0, 4, 4]) as cluster:
        assert_trained(cluster, "head0")

        # more engines than the workers' CPUs hold: stopped before any role starts
        small = train(cluster, "toomany", "rollout.num_engines=4", timeout_s=300)
        assert small.returncode == 1, small.stderr[-3000:]
        assert "the run does not fit the Ray cluster" in small.stderr
        assert "short by {CPU: 0.25}" in small.stderr  # 5.25 + 3 more engines asked, 8 offered
        assert "rollout.num_engines" in small.stderr
        assert "starting roles" not in small.stderr

        # two SIGTERMs while the roles start: the process ends
        log = workdir / "sigterm.log"
        argv = [*RELAX, "train", "quickstart.yaml", "run.name=sigterm", *SHORT]
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
        assert "SIGTERM again: stopping now" in text, text[-3000:]
        assert not steps_of(workdir / "runs" / "sigterm")


@pytest.mark.full
def test_head_with_one_cpu(workdir):
    with SimulatedCluster(workdir, cpus=[1, 4, 4]) as cluster:
        assert_trained(cluster, "head1")
