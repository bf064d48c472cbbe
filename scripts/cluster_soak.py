"""Train the quickstart on the two cluster shapes Ray recommends, many times in a row: a head that only
coordinates (`--num-cpus=0`) or has one CPU, and two 4-CPU workers, on simulated hosts (network
namespaces, tests/cluster/netns.py; needs root). Each run gets a fresh cluster, so the order of the
node ids (which once decided where TransferQueue's storage unit went, and whether the run hung) is drawn
again every time. A run passes when it exits 0 with every step logged and complete checkpoints.

    sudo .venv/bin/python scripts/cluster_soak.py --runs 10            # both shapes
    sudo .venv/bin/python scripts/cluster_soak.py --runs 3 --shapes head0

Prints one line per run and a table (shape, runs, passed, median seconds) in Markdown for docs/cluster.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster.netns import SimulatedCluster, netns_unavailable  # noqa: E402
from tests.cluster.test_cluster_shapes import (  # noqa: E402
    STEPS,
    complete_checkpoints,
    quickstart_workdir,
    steps_of,
    train,
)

SHAPES = {"head0": [0, 4, 4], "head1": [1, 4, 4]}
RUN_TIMEOUT_S = 900  # a hang is a failure, not a stuck soak


def one_run(work: Path, cpus: list[int], name: str) -> tuple[bool, float, str]:
    """One fresh cluster, one training run: (passed, seconds of the run, why it failed)."""
    with SimulatedCluster(work, cpus=cpus) as cluster:
        t0 = time.monotonic()
        try:
            done = train(cluster, name, timeout_s=RUN_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a timeout is a result here
            return False, time.monotonic() - t0, f"{type(e).__name__}: {e}"
        took = time.monotonic() - t0
    run_dir = work / "runs" / name
    steps, ckpts = steps_of(run_dir), complete_checkpoints(run_dir)
    if done.returncode != 0:
        return False, took, f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
    if steps != list(range(1, STEPS + 1)) or ckpts != [2, 4]:
        return False, took, f"steps {steps}, complete checkpoints {ckpts}"
    return True, took, ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="runs per shape (default 10)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args()
    if (why := netns_unavailable()) is not None:
        print(f"cluster_soak: {why}", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # this namespace; hosts drop it
    os.chdir(REPO)
    work = quickstart_workdir(Path(tempfile.mkdtemp(prefix="relax-soak-")))
    results: dict[str, list[tuple[bool, float, str]]] = {}
    for shape in args.shapes:
        for i in range(1, args.runs + 1):
            passed, took, why = one_run(work, SHAPES[shape], f"{shape}-{i}")
            results.setdefault(shape, []).append((passed, took, why))
            print(f"{shape} run {i}: {'passed' if passed else 'FAILED'} in {took:.0f} s {why}", flush=True)
    print("\n| head CPUs, workers | runs | passed | median run (s) |\n| --- | --- | --- | --- |")
    for shape, rows in results.items():
        cpus = SHAPES[shape]
        median = statistics.median(t for _, t, _ in rows)
        passed = sum(ok for ok, _, _ in rows)
        print(f"| {cpus[0]}, {len(cpus) - 1} x {cpus[1]} | {len(rows)} | {passed} | {median:.0f} |")
    return 0 if all(ok for rows in results.values() for ok, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
