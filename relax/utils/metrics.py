"""Metrics sinks: a machine-readable JSONL file (always) and TensorBoard event files (optional).

A sink accepts one step's flat `{name: float}` dict. To add a sink (W&B, ClearML, ...), implement
`MetricsSink` and add it in `build_sinks`.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per step to `metrics.jsonl`, flushed at once so a crash loses nothing."""

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = Path(path)
        if resume_step is not None and self.path.exists():
            self._set_aside_after(resume_step)
        self._fh = self.path.open("a")

    def _set_aside_after(self, step: int) -> None:
        """On resume, steps after the checkpoint will be run again: move their lines aside, not delete."""
        keep, redo = [], []
        for line in self.path.read_text().splitlines():
            try:
                (redo if json.loads(line).get("step", -1) > step else keep).append(line)
            except json.JSONDecodeError:
                redo.append(line)  # a torn last line from a killed run
        if redo:
            with self.path.with_name("metrics.superseded.jsonl").open("a") as fh:
                fh.write("\n".join(redo) + "\n")
            self.path.write_text("".join(line + "\n" for line in keep))
            logger.info("moved %d metrics lines after step %d to metrics.superseded.jsonl", len(redo), step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step}
        for k, v in metrics.items():
            row[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MetricsLogger:
    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_sinks(run_dir: Path, tensorboard: bool, resume_step: int | None) -> MetricsLogger:
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
    if tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard", resume_step))
    return MetricsLogger(sinks)
