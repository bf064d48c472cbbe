"""Simulated hosts for multi-host tests: Linux network namespaces joined by a bridge, one Ray node each.

Each host is a network namespace with its own loopback (so a server that binds or advertises 127.0.0.1 is
unreachable from the other hosts, as on real machines) and one address from 198.18.0.0/24 (RFC 2544's
benchmarking range). The bridge lives in a namespace of its own, so nothing is added to the machine's own
network. The hosts share the file system, as nodes of a cluster share a network file system; a host can
be started with folders hidden from it (a tmpfs mounted over them in a mount namespace of its own) to
play a node that cannot see a path.

`SimulatedCluster` makes the namespaces, starts Ray (head on host 1, workers on the others, Ray's token
authentication on) and always removes everything it made, also when a test fails; namespaces of this
prefix left by a killed earlier run are removed first.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "relaxmh"
SUBNET = "198.18.0"
RAY_PORT = 6379
DASHBOARD_PORT = 8265
START_ATTEMPTS = 3  # `ray start` per host (see SimulatedCluster._check_started)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can): the reason a test skips with."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    done = _ip("netns", "add", probe, check=False)
    if done.returncode != 0:
        return f"cannot make a network namespace: {done.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _owner_alive(name: str) -> bool:
    """Whether the process that made namespace `name` (`relaxmh-<pid>-...`) still runs: another test
    session's or script's cluster, on a machine several people share, is not a leftover."""
    parts = name.split("-")
    return len(parts) > 2 and parts[1].isdigit() and Path(f"/proc/{parts[1]}").exists()


def remove_leftovers() -> None:
    """Namespaces of this prefix left by a process that was killed, and their processes."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if name.startswith(PREFIX) and not _owner_alive(name):
            _kill_all(name)
            _ip("netns", "del", name, check=False)


def _kill_all(ns: str, sig: int = 9) -> int:
    """Send `sig` to every process in namespace `ns`; returns how many there were."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), sig)
        except (ProcessLookupError, ValueError):
            pass
    return len(pids)


@dataclass
class Host:
    index: int  # 1-based
    ns: str
    address: str
    temp_dir: Path
    hidden: list[Path] = field(default_factory=list)  # folders this host does not see


class SimulatedCluster:
    """`hosts` Ray nodes: host i gets `cpus[i-1]` logical CPUs, the Ray node labels `labels[i-1]` and the
    custom resources `resources[i-1]`; `hidden[i-1]` lists folders that host cannot see. Host 1 is the
    head (and where drivers run)."""

    def __init__(
        self,
        workdir: Path,
        cpus: list[int],
        labels: list[dict[str, str]] | None = None,
        hidden: list[list[Path]] | None = None,
        resources: list[dict[str, float]] | None = None,
    ) -> None:
        self.workdir = workdir
        self.cpus = cpus
        self.labels = labels or [{} for _ in cpus]
        self.resources = resources or [{} for _ in cpus]
        self.token = secrets.token_hex(16)
        tag = f"{PREFIX}-{os.getpid()}"  # the owner's pid: `remove_leftovers` spares live owners
        self.switch = f"{tag}-sw"
        # Ray's socket paths must stay under 108 bytes: its temp folders go to a short path of their own
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="rmh", dir="/tmp"))
        self.hosts = [
            Host(
                i,
                f"{tag}-h{i}",
                f"{SUBNET}.{i}",
                self.ray_tmp / f"h{i}",
                list((hidden or [[]] * len(cpus))[i - 1]),
            )
            for i in range(1, len(cpus) + 1)
        ]
        self._made: list[str] = []

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        return f"{self.head.address}:{RAY_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.head.address}:{DASHBOARD_PORT}"

    # -- life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> SimulatedCluster:
        remove_leftovers()
        try:
            self._network()
            self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _network(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            self._made.append(h.ns)
            _ip(
                "link",
                "add",
                "eth0",
                "netns",
                h.ns,
                "type",
                "veth",
                "peer",
                "name",
                f"p{h.index}",
                "netns",
                self.switch,
            )
            _ip("-n", self.switch, "link", "set", f"p{h.index}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{h.index}", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process on a simulated host: the node address is the host's own (the
        loopback-only Ray setting is left out), Ray's token authentication is on."""
        env = {
            k: v
            for k, v in os.environ.items()
            # the test session's own Ray token (RAY_AUTH_TOKEN_PATH) is not the simulated cluster's
            if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")
        }
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, PYTHONUNBUFFERED="1")
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
        repo = str(Path(__file__).resolve().parents[2])  # test helpers (`tests.cluster.ops_client`)
        env["PYTHONPATH"] = ":".join(p for p in (env.get("PYTHONPATH"), repo) if p)
        env.update(extra)
        return env

    def _argv(self, host: Host, argv: list[str]) -> list[str]:
        if host.hidden:  # a mount namespace of its own, with each hidden folder covered by an empty tmpfs
            mounts = " && ".join(f"mount -t tmpfs relax-hidden {str(p)!r}" for p in host.hidden)
            script = f'{mounts} && exec "$@"'
            return [
                "ip",
                "netns",
                "exec",
                host.ns,
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
                "sh",
                *argv,
            ]
        return ["ip", "netns", "exec", host.ns, *argv]

    def run(self, host: int, argv: list[str], timeout_s: float, **env: str) -> subprocess.CompletedProcess:
        """Run `argv` on host `host` (1-based) in the work folder and wait for it; output is captured."""
        h = self.hosts[host - 1]
        return subprocess.run(
            self._argv(h, argv),
            cwd=self.workdir,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def popen(self, host: int, argv: list[str], log: Path, **env: str) -> subprocess.Popen:
        h = self.hosts[host - 1]
        fh = log.open("w")
        return subprocess.Popen(
            self._argv(h, argv), cwd=self.workdir, env=self.env(**env), stdout=fh, stderr=subprocess.STDOUT
        )

    def _start_ray(self) -> None:
        """The head, then the other hosts side by side (each `ray start` is seconds of Python imports
        and process launches, mostly waiting on one core)."""
        starts = [self._ray_start_argv(i) for i in range(len(self.hosts))]
        self._check_started(1, self.run(1, starts[0], timeout_s=180))
        procs = [
            (
                h.index,
                subprocess.Popen(
                    self._argv(h, argv),
                    cwd=self.workdir,
                    env=self.env(),
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                ),
            )
            for h, argv in zip(self.hosts[1:], starts[1:], strict=True)
        ]
        for index, proc in procs:
            out, err = proc.communicate(timeout=180)
            self._check_started(index, subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        self.wait_for_nodes(len(self.hosts))

    def _check_started(self, index: int, done: subprocess.CompletedProcess) -> None:
        """A host whose node timed out during startup (Ray's raylet gives its dashboard agent a fixed 15 s,
        which a busy machine misses: relax/orchestration/local_ray.py) is started again after its
        namespace's leftover processes are killed, up to START_ATTEMPTS times; other failures raise."""
        for _ in range(START_ATTEMPTS - 1):
            if done.returncode == 0 or "timed out during startup" not in done.stdout + done.stderr:
                break
            _kill_all(self.hosts[index - 1].ns)
            done = self.run(index, self._ray_start_argv(index - 1), timeout_s=180)
        if done.returncode != 0:
            raise RuntimeError(
                f"ray start on host {index} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )

    def _ray_start_argv(self, i: int) -> list[str]:
        """`ray start` for host `i` (0-based): the head, or a node that joins it."""
        h, labels, res = self.hosts[i], self.labels[i], self.resources[i]
        args = [
            str(Path(sys.executable).parent / "ray"),
            "start",
            f"--node-ip-address={h.address}",
            f"--num-cpus={self.cpus[i]}",
            "--num-gpus=0",
            f"--temp-dir={h.temp_dir}",
            "--disable-usage-stats",
            "--object-store-memory=300000000",
        ]
        if labels:
            args.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
        if res:
            args.append("--resources=" + json.dumps(res))
        if h.index == 1:
            args += [
                "--head",
                f"--port={RAY_PORT}",
                f"--dashboard-host={h.address}",
                f"--dashboard-port={DASHBOARD_PORT}",
                "--include-dashboard=true",
            ]
        else:
            args.append(f"--address={self.address}")
        return args

    def wait_for_nodes(self, n: int, timeout_s: float = 120) -> None:
        code = (
            "import ray, time\n"
            f"ray.init(address={self.address!r}, logging_level='ERROR')\n"
            f"deadline = time.time() + {timeout_s}\n"
            f"while sum(x['Alive'] for x in ray.nodes()) < {n} and time.time() < deadline: time.sleep(0.5)\n"
            "print(sum(x['Alive'] for x in ray.nodes()))\n"
        )
        done = self.run(1, [sys.executable, "-c", code], timeout_s=timeout_s + 60)
        alive = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "?"
        if alive != str(n):
            raise RuntimeError(f"{alive} of {n} Ray nodes alive:\n{done.stderr[-3000:]}")

    def close(self) -> None:
        """Kill the hosts' processes (SIGKILL: the cluster is thrown away, and a graceful stop waited 10 s
        for a process that ignored SIGTERM), remove the namespaces. Never raises.

        Not `ray stop`: it finds Ray's processes by name across the whole machine (a network namespace
        does not hide processes), so it also killed the test session's own Ray cluster, and the pytest
        process with it (Ray's driver exits when its raylet dies) at the next test that used Ray."""
        deadline = time.monotonic() + 10
        # again until none is left: a raylet may start a worker while its neighbours are killed
        while sum(_kill_all(ns) for ns in reversed(self._made)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
