"""One timing helper: `with timer("rollout", times): ...` records seconds under `perf/<name>_s`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def timer(name: str, into: dict[str, float]) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        into[f"perf/{name}_s"] = into.get(f"perf/{name}_s", 0.0) + time.perf_counter() - start
