"""Clusters as Ray recommends starting them (tests/cluster/netns.py: three simulated hosts), with nothing
labelled: a head with a single CPU and two 4-CPU workers. The quickstart trains to its last step with
complete checkpoints: every actor (roles, engine, TransferQueue's controller and storage unit) lands where
its CPUs are.

The full tier (`bash scripts/test.sh --full`, which also runs scripts/cluster_soak.py: a 0-CPU and a
1-CPU head ten times in a row). CI runs the 0-CPU head, labelled, with its shortfall and SIGTERM checks
in tests/cluster/test_multi_host.py.
"""

from __future__ import annotations

import json
import sys
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


@pytest.mark.full
def test_head_with_one_cpu(workdir):
    with SimulatedCluster(workdir, cpus=[1, 4, 4]) as cluster:
        assert_trained(cluster, "head1")
