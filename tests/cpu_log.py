"""CPU-seconds per test, for measuring the suite on a machine whose speed moves from day to day.

Wall time on the shared 2-core machines moves by a tenth between clean clones and by a quarter between
days with the same code (docs/measurements.md); the CPU a test costs moves far less, and the suite is
bound by CPU (the two cores ~1.7 busy on average). With `RELAX_TEST_CPU_LOG=FILE`, each test appends one
JSON line to FILE: its queue, node id, wall seconds and the CPU-seconds its queue's processes spent
meanwhile (setup, call and teardown), every process a test starts included: Ray's daemons and workers,
engines, `relax train` children. That last part needs the queue in a cgroup of its own, which
`scripts/test.sh` makes when it runs as root (`cpu_cgroup` there); elsewhere the line carries
`"cpu_s": null`. `python benchmarks/suite_cpu.py FILE` prints the tables.

Registered by tests/conftest.py when the variable is set; nothing here runs otherwise.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

LOG_ENV = "RELAX_TEST_CPU_LOG"


CGROUP_ENV = "RELAX_TEST_CPU_CGROUP"  # the queue's cgroup folder, set by scripts/test.sh


def cgroup_cpu_file(folder: str | None) -> Path | None:
    """The file holding the CPU total of the cgroup at `folder`: cgroup v1's `cpuacct.usage` (ns) or
    v2's `cpu.stat` (its `usage_usec` line); None without one."""
    if not folder:
        return None
    for name in ("cpuacct.usage", "cpu.stat"):
        if (Path(folder) / name).exists():
            return Path(folder) / name
    return None


def read_cpu_s(source: Path | None) -> float | None:
    if source is None:
        return None
    text = source.read_text()
    if source.name == "cpuacct.usage":
        return int(text) / 1e9
    for line in text.splitlines():
        if line.startswith("usage_usec "):
            return int(line.split()[1]) / 1e6
    return None


class CpuLog:
    """The plugin: one JSON line per test (module docstring)."""

    def __init__(self, out: Path, queue: str) -> None:
        # only a cgroup made for the queue counts the queue alone: the root cgroup holds the whole machine
        self.source = cgroup_cpu_file(os.environ.get(CGROUP_ENV))
        self.out, self.queue = out, queue

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        cpu0, wall0 = read_cpu_s(self.source), time.monotonic()
        yield
        cpu1 = read_cpu_s(self.source)
        row = {
            "queue": self.queue,
            "test": item.nodeid,
            "wall_s": round(time.monotonic() - wall0, 3),
            "cpu_s": None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 3),
        }
        with self.out.open("a") as fh:  # one short line per write: the queues append side by side
            fh.write(json.dumps(row) + "\n")


def register(config: pytest.Config) -> None:
    """Add the plugin when `RELAX_TEST_CPU_LOG` names a file."""
    out = os.environ.get(LOG_ENV)
    if out:
        queue = os.environ.get("RELAX_TEST_QUEUE") or "tests"
        config.pluginmanager.register(CpuLog(Path(out), queue), "relax_cpu_log")
