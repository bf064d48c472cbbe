"""CPU budgets: the CPU-list syntax, and pinning every thread of a process (those it already has and
those it starts later)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from relax.utils.cpu_affinity import parse_cpu_list, pin_process, with_cpu_affinity

LINUX = hasattr(os, "sched_setaffinity")


@pytest.mark.parametrize(
    ("text", "cpus"), [("0", {0}), ("0-2,5", {0, 1, 2, 5}), (" 1 , 3 ", {1, 3}), ("2-2", {2})]
)
def test_cpu_lists_parse(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "", "0-", "-1", "1.5"])
def test_malformed_cpu_lists_are_named(text):
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list(text)


def test_a_cpu_the_host_lacks_is_an_error_naming_the_setting():
    with pytest.raises(ValueError, match=r"resources.rollout_cpus='4096'.*this host has CPUs"):
        pin_process("4096", "resources.rollout_cpus")


def test_no_cpus_leaves_the_class_alone():
    class Role:
        pass

    assert with_cpu_affinity(Role, None, "x") is Role
    assert with_cpu_affinity(Role, "0", "x") is not Role


PROBE = """
import json, os, sys, threading
from relax.utils.cpu_affinity import with_cpu_affinity

stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()

class Role:
    def __init__(self):
        self.after = threading.Thread(target=stop.wait); self.after.start()

role = with_cpu_affinity(Role, sys.argv[1], "resources.training_cpus")()
tids = [int(t) for t in os.listdir("/proc/self/task")]
print(json.dumps({t: sorted(os.sched_getaffinity(t)) for t in tids}))
stop.set()
"""


@pytest.mark.skipif(not LINUX or (os.cpu_count() or 1) < 2, reason="needs Linux and 2+ CPUs")
def test_every_thread_of_the_process_is_pinned():
    """A thread started before pinning and one the role's constructor starts both end up on the CPU."""
    last = max(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(last)], capture_output=True, text=True, timeout=60, check=True
    )
    threads = json.loads(out.stdout)
    assert len(threads) >= 3  # main, the one before, the one the constructor started
    assert all(cpus == [last] for cpus in threads.values()), threads
