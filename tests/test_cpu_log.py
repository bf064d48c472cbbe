"""The suite's CPU log (tests/cpu_log.py) and its tables (benchmarks/suite_cpu.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.cpu_log import CGROUP_ENV, CpuLog, cgroup_cpu_file, read_cpu_s

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from suite_cpu import report  # noqa: E402


@pytest.mark.parametrize(
    ("name", "text", "seconds"),
    [("cpuacct.usage", "2500000000\n", 2.5), ("cpu.stat", "usage_usec 1500000\nuser_usec 1\n", 1.5)],
)
def test_both_cgroup_versions_are_read(tmp_path, name, text, seconds):
    (tmp_path / name).write_text(text)
    assert read_cpu_s(cgroup_cpu_file(str(tmp_path))) == seconds
    assert cgroup_cpu_file(str(tmp_path / "missing")) is None and cgroup_cpu_file(None) is None


def test_a_test_gets_the_cpu_its_queue_spent_meanwhile(tmp_path, monkeypatch):
    usage = tmp_path / "cg" / "cpuacct.usage"
    usage.parent.mkdir()
    usage.write_text("1000000000")
    monkeypatch.setenv(CGROUP_ENV, str(usage.parent))
    log = CpuLog(tmp_path / "cpu.jsonl", "e2e")
    for nodeid, spent_ns in (("tests/a.py::t1", 3_000_000_000), ("tests/b.py::t2", 500_000_000)):
        hook = log.pytest_runtest_protocol(SimpleNamespace(nodeid=nodeid))
        next(hook)
        usage.write_text(str(int(usage.read_text()) + spent_ns))  # what the test's processes spent
        with pytest.raises(StopIteration):
            next(hook)
    rows = [json.loads(line) for line in (tmp_path / "cpu.jsonl").read_text().splitlines()]
    assert [(r["queue"], r["test"], r["cpu_s"]) for r in rows] == [
        ("e2e", "tests/a.py::t1", 3.0),
        ("e2e", "tests/b.py::t2", 0.5),
    ]
    table = report(rows, top=5, base=[{**rows[0], "cpu_s": 4.0}])
    assert "e2e" in table and "3.5" in table  # the queue's total
    assert "(base 4.0 cpu s" in table  # a.py against the base log


def test_without_a_cgroup_of_its_own_only_wall_time_is_logged(tmp_path, monkeypatch):
    monkeypatch.delenv(CGROUP_ENV, raising=False)
    log = CpuLog(tmp_path / "cpu.jsonl", "unit")
    hook = log.pytest_runtest_protocol(SimpleNamespace(nodeid="tests/c.py::t"))
    next(hook)
    with pytest.raises(StopIteration):
        next(hook)
    (row,) = [json.loads(line) for line in (tmp_path / "cpu.jsonl").read_text().splitlines()]
    assert row["cpu_s"] is None and row["wall_s"] >= 0
    assert "no CPU figures" in report([row], top=5, base=None)
