"""Where a fault cell's run runs, and how the harness finds the run's processes: on this host (processes
found by the cell's marker in their environment) or as the driver on host 1 of the simulated three-host
cluster (tests/cluster/netns.py; processes found by namespace). Both are context managers that remove
every process they started, and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOOK_DIR = Path(__file__).resolve().parent / "hook"
RELAX = [sys.executable, "-m", "relax.entrypoints.cli"]

# how a role's process is named (Ray's process title)
TITLES = {
    "engine": "ray::EngineActor",
    "rollout": "ray::ServeReplica:rollout:",
    "actor": "ray::ServeReplica:actor:",
    "actor_fwd": "ray::ServeReplica:actor_fwd:",
    "metrics": "ray::ServeReplica:metrics:",
}


def marked_pids(marker: str) -> set[int]:
    """Live processes whose environment holds `marker` (every process a run starts inherits it; other
    Ray clusters on the machine do not count)."""
    pids = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                pids.add(int(environ.parent.name))
        except OSError:  # the process ended or is not ours to read
            pass
    pids.discard(os.getpid())
    return pids


def process_title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def kill_pids(pids: set[int] | list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# -- where the run runs -----------------------------------------------------------------------------
@dataclass
class Assets:
    model: Path
    data: Path
    eval_data: Path


def make_assets(folder: Path) -> Assets:
    """The tiny model and the toy data, written once and shared by every cell."""
    from relax.data.toy import generate_arith
    from relax.models.tiny import write_tiny_model

    a = Assets(folder / "model", folder / "arith.jsonl", folder / "arith_eval.jsonl")
    if not (a.model / "config.json").exists():
        write_tiny_model(a.model, family="qwen2")
    if not a.data.exists():
        generate_arith(a.data, n=500, seed=0)
    if not a.eval_data.exists():
        generate_arith(a.eval_data, n=16, seed=1)
    return a


class OneHost:
    """The run as a subprocess here; its processes are those with the cell's fault folder in their
    environment (Ray's processes and workers inherit it)."""

    def __init__(self, fault_dir: Path) -> None:
        self.marker = f"RELAX_FAULT_DIR={fault_dir}"
        self.fault_dir = fault_dir

    def __enter__(self) -> OneHost:
        return self

    def __exit__(self, *exc: object) -> None:
        kill_pids(self.pids())

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
        path = ":".join(p for p in (str(HOOK_DIR), str(REPO), env.get("PYTHONPATH")) if p)
        env.update(
            RELAX_FAULT_DIR=str(self.fault_dir),
            PYTHONPATH=path,
            RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # never unset outside a network namespace: Ray would reach for the real interface
            RELAX_LOG_LEVEL="INFO",
            PYTHONUNBUFFERED="1",
        )
        return env

    def start(self, args: list[str], log: Path) -> subprocess.Popen:
        with log.open("a") as fh:
            return subprocess.Popen(
                [*RELAX, "train", *args],
                cwd=REPO,
                env=self.env(),
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def pids(self) -> set[int]:
        return marked_pids(self.marker)

    def find(self, role: str) -> int | None:
        for pid in sorted(self.pids()):
            if process_title(pid).startswith(TITLES[role]):
                return pid
        return None

    def leftovers(self, driver: subprocess.Popen) -> set[int]:
        return self.pids()


PREFIX = "relaxft"  # the suite's own namespaces (tests/cluster uses "relaxmh")


class Cluster:
    """The run's driver on host 1 of three simulated hosts (head 2 CPUs, workers 6 each, no labels:
    Ray places every role); the hosts' Ray nodes carry the fault folder and the hook in their
    environment. Its processes are those of the hosts' namespaces.

    The namespaces carry a prefix of their own: `SimulatedCluster` removes every namespace of its
    prefix on entry (leftovers of a killed run), which on a machine shared by several sessions also
    removes another session's live cluster; this suite removes only its own."""

    CPUS = [2, 6, 6]

    def __init__(self, fault_dir: Path, workdir: Path) -> None:
        from tests.cluster import netns

        hook = str(HOOK_DIR)

        class Hosts(netns.SimulatedCluster):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                tag = f"{PREFIX}-{os.getpid() % 100000}"
                self.switch = f"{tag}-sw"
                for h in self.hosts:
                    h.ns = f"{tag}-h{h.index}"

            def __enter__(self) -> Hosts:
                for line in netns._ip("netns", "list", check=False).stdout.splitlines():
                    name = line.split(" ")[0]
                    if name.startswith(PREFIX):  # ours, left by a killed run of the suite
                        netns._kill_all(name)
                        netns._ip("netns", "del", name, check=False)
                try:
                    self._network()
                    self._start_ray()
                except BaseException:
                    self.close()
                    raise
                return self

            def env(self, **extra: str) -> dict[str, str]:
                env = super().env(**extra)
                env["PYTHONPATH"] = f"{hook}:{env['PYTHONPATH']}"
                env.update(RELAX_FAULT_DIR=str(fault_dir), RELAX_LOG_LEVEL="INFO")
                return env

        self.sim = Hosts(workdir, cpus=self.CPUS)
        self.fault_dir = fault_dir

    def __enter__(self) -> Cluster:
        self.sim.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sim.close()

    def start(self, args: list[str], log: Path) -> subprocess.Popen:
        return self.sim.popen(1, [*RELAX, "train", *args], log, RAY_ADDRESS=self.sim.address)

    def host_pids(self, index: int) -> set[int]:
        ns = self.sim.hosts[index - 1].ns
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        return {int(p) for p in out.split()}

    def pids(self) -> set[int]:
        return set().union(*(self.host_pids(h.index) for h in self.sim.hosts))

    def find(self, role: str) -> int | None:
        for pid in sorted(self.pids()):
            if process_title(pid).startswith(TITLES[role]):
                return pid
        return None

    def leftovers(self, driver: subprocess.Popen) -> set[int]:
        # the cluster's own Ray processes stay up by design; the run's workers are gone with its driver
        return {p for p in self.pids() if process_title(p).startswith(tuple(TITLES.values()))}
