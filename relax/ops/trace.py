"""Timeline traces of each step's phases in the Chrome trace format (open `trace.json` in
chrome://tracing or https://ui.perfetto.dev).

`StepPhases` times the phases of one step (as `relax.utils.timer` does, into `perf/<name>_s`) and keeps
their start times; `TraceWriter` appends them as complete ("X") events. The file is the format's
JSON-array form with one event per line, left unterminated as the format allows, so a run killed at any
point leaves a readable trace; `read_trace` parses it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Span:
    name: str  # phase name (rollout, train, weight_sync, ...)
    start_s: float  # wall-clock start, seconds since the epoch
    dur_s: float  # duration in seconds


@dataclass
class StepPhases:
    """The phases of one step: `with phases.phase("rollout"): ...`."""

    times: dict[str, float] = field(default_factory=dict)  # perf/<name>_s -> seconds (summed)
    spans: list[Span] = field(default_factory=list)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        wall, start = time.time(), time.perf_counter()
        try:
            yield
        finally:
            dur = time.perf_counter() - start
            key = f"perf/{name}_s"
            self.times[key] = self.times.get(key, 0.0) + dur
            self.spans.append(Span(name, wall, dur))


class TraceWriter:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._fh = self.path.open("a")
        if fresh:
            self._fh.write("[\n")
            self._fh.flush()

    def write(self, step: int, spans: list[Span], process: str = "controller") -> None:
        for s in spans:
            event = {
                "name": s.name,
                "cat": "step",
                "ph": "X",
                "ts": round(s.start_s * 1e6),  # microseconds
                "dur": round(s.dur_s * 1e6),
                "pid": process,
                "tid": "loop",
                "args": {"step": step},
            }
            self._fh.write(json.dumps(event) + ",\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a trace file written by `TraceWriter` (terminated or not)."""
    text = Path(path).read_text().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "\n]"
    return json.loads(text)
