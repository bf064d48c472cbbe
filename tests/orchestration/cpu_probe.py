"""A role that reports its process id (tests/orchestration/test_cpu_budgets.py). In a module of its own
so that Serve replicas import it by its package path."""

from __future__ import annotations

import os


class Probe:
    def __init__(self, cfg: object) -> None:
        self.cfg = cfg

    def pid(self) -> int:
        return os.getpid()
