"""A class for the gc-freeze tests, imported as ``tests.utils.gc_probe`` so that Ray workers (which have
the repository root on ``sys.path``) can import it."""

from __future__ import annotations

import gc


class Probe:
    def __init__(self, payload: int) -> None:
        self.payload = payload

    def frozen(self) -> int:
        return gc.get_freeze_count()


class StartupProbe:
    """Reports the collector's thresholds before Relax is imported in this (fresh) worker, after, and
    after `freeze_startup_objects`."""

    def thresholds(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        before = gc.get_threshold()
        from relax.utils.gc_freeze import freeze_startup_objects

        during = gc.get_threshold()
        freeze_startup_objects()
        return before, during, gc.get_threshold()
