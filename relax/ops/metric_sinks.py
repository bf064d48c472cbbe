"""Metrics sinks: a machine-readable JSONL file (always), TensorBoard event files, Weights & Biases and
ClearML (each optional; W&B and ClearML are imported only when configured).

A sink accepts one step's flat `{name: float}` dict. To add a sink, implement `MetricsSink` and add it in
`build_sinks`. The sinks live in the metrics service (`relax.roles.metrics`).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from relax.config import RelaxConfig

from relax.utils.redact import redact_tree

logger = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per step to `metrics.jsonl`, flushed at once so a crash loses nothing.
    Each row is `{"step": k, "time": <unix seconds when it was written>, <metric>: value, ...}`."""

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
        row = {"step": step, "time": time.time()}
        for k, v in metrics.items():
            row[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class TensorBoardSink:
    """Scalars as TensorBoard event files, through the `tensorboard` package's own event writer. torch's
    `SummaryWriter` wraps the same writer but imports torch, which the Metrics replica otherwise does not
    need: about 1.5 s of CPU at every start of the role, and torch's memory for its whole life."""

    def __init__(self, log_dir: Path, resume_step: int | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self.writer = EventFileWriter(str(log_dir))
        if resume_step is not None:
            # a session start at the first step after the checkpoint: TensorBoard then discards the
            # points an earlier attempt wrote for the steps this one writes again
            start = SessionLog(status=SessionLog.START)
            self.writer.add_event(Event(step=resume_step + 1, wall_time=time.time(), session_log=start))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        values = [
            self._summary.Value(tag=k, simple_value=float(v))
            for k, v in metrics.items()
            if isinstance(v, (int, float))
        ]
        if values:
            summary = self._summary(value=values)
            self.writer.add_event(self._event(step=step, wall_time=time.time(), summary=summary))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _scalars(metrics: dict[str, float]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class WandbSink:
    """One W&B run per training attempt; `mode=offline` writes `<run_dir>/wandb/offline-run-*` without a
    network (upload later with `wandb sync`)."""

    def __init__(
        self, run_dir: Path, run_name: str, project: str, entity: str | None, mode: str, config: dict
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError("ops.wandb needs the wandb package: pip install 'relax[metrics]'") from e
        self.run = wandb.init(
            project=project,
            entity=entity,
            name=run_name,
            dir=str(run_dir),
            mode=mode,
            config=redact_tree(config),  # credentials stay out of W&B's run config
            reinit="create_new",
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        """Finish the run and stop W&B's service process. `finish()` returns once the service has
        taken the run's end, but the service flushes the run's `.wandb` log later (at its own teardown,
        normally an `atexit` hook). A Ray actor can exit without running `atexit` hooks, so the flush
        is forced here; this process owns no other W&B run."""
        import wandb

        self.run.finish()
        wandb.teardown()


class ClearMLSink:
    """A ClearML task; `offline=True` records it locally under ClearML's cache (upload later)."""

    def __init__(self, run_name: str, project: str, offline: bool, config: dict) -> None:
        try:
            from clearml import Task
        except ImportError as e:
            raise ImportError("ops.clearml needs the clearml package: pip install clearml") from e
        if offline:
            Task.set_offline(offline_mode=True)
        self.task = Task.init(
            project_name=project,
            task_name=run_name,
            reuse_last_task_id=False,
            auto_connect_frameworks=False,
            auto_resource_monitoring=False,
        )
        self.task.connect(config)
        self.logger = self.task.get_logger()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in _scalars(metrics).items():
            title, _, series = k.partition("/")
            self.logger.report_scalar(title, series or title, v, iteration=step)

    def close(self) -> None:
        self.task.close()


class MetricsLogger:
    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_sinks(cfg: RelaxConfig, resume_step: int | None) -> MetricsLogger:
    """The sinks `cfg.ops` enables; `resume_step` (a resumed run) sets aside what came after it."""
    run_dir, ops = cfg.run.run_dir, cfg.ops
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
    if ops.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard", resume_step))
    config = redact_tree(cfg.model_dump(mode="json"))  # what W&B and ClearML record of the run
    if ops.wandb is not None:
        w = ops.wandb
        sinks.append(WandbSink(run_dir, cfg.run.name, w.project, w.entity, w.mode, config))
    if ops.clearml is not None:
        sinks.append(ClearMLSink(cfg.run.name, ops.clearml.project, ops.clearml.offline, config))
    return MetricsLogger(sinks)
