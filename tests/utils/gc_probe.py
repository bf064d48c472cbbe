"""A class for the gc-freeze tests, imported as ``tests.utils.gc_probe`` so that Ray workers (which have
the repository root on ``sys.path``) can import it."""

from __future__ import annotations

import gc


class Probe:
    def __init__(self, payload: int) -> None:
        self.payload = payload

    def frozen(self) -> int:
        return gc.get_freeze_count()
