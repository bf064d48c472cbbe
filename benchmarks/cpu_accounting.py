"""CPU time per training step of each process of a run, from /proc (Linux): where a mode's CPU goes.

On a small host fully_async is bound by CPU throughput rather than by any one role: rollout and training
run at once, so a step costs about (CPU of all processes per step) / (cores x utilisation). This module
samples every process's user + system ticks when the run's `metrics.jsonl` reaches the first and the
last counted step and names each process by its role (Ray Serve replicas, the engine, TransferQueue's
controller and storage, Ray's own daemons, the driver).

    with StepWindow(metrics_path, first=3, last=19) as window:
        run()
    print(format_table({"fully_async": window.result()}))
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_NAMES = [  # (pattern on the command line, label); the first match wins
    (r"ray::ServeReplica:(\w+)", None),  # the role's name
    (r"ray::EngineActor", "engine"),
    (r"ray::TransferQueueController", "tq_controller"),
    (r"ray::SimpleStorageUnit", "tq_storage"),
    (r"ray::ServeController", "serve_controller"),
    (r"ray::(\w+)", None),  # other Ray actors by class
    (r"gcs_server|raylet|log_monitor|dashboard|runtime_env", "ray_daemons"),
]


def _label(pid: int, cmdline: str) -> str:
    if pid == os.getpid():
        return "driver"
    for pattern, label in _NAMES:
        m = re.search(pattern, cmdline)
        if m:
            return label or m.group(1)
    return "other"


def snapshot() -> dict[int, tuple[str, int]]:
    """pid -> (label, user + system ticks) of every readable process."""
    out: dict[int, tuple[str, int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
        out[int(proc.name)] = (_label(int(proc.name), cmdline), int(fields[11]) + int(fields[12]))
    return out


def cpu_by_label(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, float]:
    """CPU seconds per label between two snapshots (processes alive at both)."""
    total: dict[str, float] = {}
    for pid, (label, ticks) in after.items():
        if pid in before:
            total[label] = total.get(label, 0.0) + (ticks - before[pid][1]) * TICK_S
    return total


class StepWindow:
    """Snapshots /proc when `metrics` holds `first` rows and again at `last` rows (a background thread
    polling the file); `result()` gives CPU milliseconds per step per label, plus `total`, `wall_ms` per
    step and `utilisation` (total CPU / (wall x cores))."""

    def __init__(self, metrics: Path, first: int, last: int, poll_s: float = 0.05) -> None:
        if last <= first:
            raise ValueError(f"need last > first steps, got {first}..{last}")
        self.metrics, self.first, self.last, self.poll_s = metrics, first, last, poll_s
        self.marks: list[tuple[float, dict[int, tuple[str, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="cpu-window")

    def __enter__(self) -> StepWindow:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _rows(self) -> int:
        try:
            return self.metrics.read_bytes().count(b"\n")
        except OSError:
            return 0

    def _watch(self) -> None:
        for target in (self.first, self.last):
            while not self._stop.is_set() and self._rows() < target:
                time.sleep(self.poll_s)
            if self._stop.is_set():
                return
            self.marks.append((time.monotonic(), snapshot()))

    def result(self) -> dict[str, float]:
        if len(self.marks) < 2:
            return {}
        (t0, before), (t1, after) = self.marks
        steps = self.last - self.first
        per_step = {k: 1e3 * v / steps for k, v in cpu_by_label(before, after).items()}
        total = sum(per_step.values())
        wall = 1e3 * (t1 - t0) / steps
        return {
            **per_step,
            "total": total,
            "wall_ms": wall,
            "utilisation": total / (wall * (os.cpu_count() or 1)),
        }


def format_table(results: dict[str, dict[str, float]]) -> str:
    """One column per run: CPU ms per step of each label (largest first), then total, wall, utilisation."""
    runs = [r for r in results if results[r]]
    if not runs:
        return "cpu accounting: no window was sampled (run shorter than the window, or no /proc)"
    tail = ("total", "wall_ms", "utilisation")
    labels = sorted(
        {k for r in runs for k in results[r]} - set(tail),
        key=lambda k: -max(results[r].get(k, 0.0) for r in runs),
    )
    lines = [f"{'CPU ms per step':<20}" + "".join(f"{r:>14}" for r in runs)]
    for k in [*labels, *tail]:
        fmt = "{:>14.2f}" if k == "utilisation" else "{:>14.1f}"
        lines.append(f"{k:<20}" + "".join(fmt.format(results[r].get(k, 0.0)) for r in runs))
    return "\n".join(lines)
