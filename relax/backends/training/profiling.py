"""What a training rank measures of each training step: the seconds of its forward-only passes, its
peak and reserved GPU memory, and, for the steps listed in `RELAX_PROFILE_STEPS`, a torch-profiler
record of the whole step on the rank (every forward-only pass of the step and the update).

`RELAX_PROFILE_STEPS=3,7` (and `RELAX_PROFILE_DIR`, default `profiles`) writes per profiled step and rank
`train_step<N>_rank<R>.txt` (the top operators by device time, and allocator counters) and
`train_step<N>_rank<R>.json.gz` (a Chrome trace: chrome://tracing or https://ui.perfetto.dev).
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

GB = 1e9


def profiled_steps() -> set[int]:
    return {int(x) for x in os.environ.get("RELAX_PROFILE_STEPS", "").split(",") if x.strip()}


class StepProbe:
    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.forward_s = 0.0  # forward-only seconds since the last update
        self._prof: Any = None
        self._prof_step = 0

    @contextlib.contextmanager
    def forward(self, step: int) -> Iterator[None]:
        """Around a forward-only pass made for training step `step` (its results are on the host after
        it, so the clock covers the device's work)."""
        self._start(step)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.forward_s += time.perf_counter() - t0

    @contextlib.contextmanager
    def update(self, step: int) -> Iterator[None]:
        """Around the update of training step `step`; ends the step's profile."""
        self._start(step)
        try:
            yield
        finally:
            self._finish()

    def metrics(self) -> dict[str, float]:
        """The step's rank metrics (taken once per update; the counters restart)."""
        out = {"perf/rank_forward_s": self.forward_s}
        self.forward_s = 0.0
        if self.device.type == "cuda":
            out["perf/rank_peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / GB
            out["perf/rank_reserved_memory_gb"] = torch.cuda.memory_reserved(self.device) / GB
            torch.cuda.reset_peak_memory_stats(self.device)
        return out

    # -- the profiler --------------------------------------------------------------------------
    def _start(self, step: int) -> None:
        if self._prof is not None or step not in profiled_steps():
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof, self._prof_step = profile(activities=acts), step
        self._prof.__enter__()

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        prof.__exit__(None, None, None)
        out = Path(os.environ.get("RELAX_PROFILE_DIR", "profiles"))
        out.mkdir(parents=True, exist_ok=True)
        name = f"train_step{self._prof_step}_rank{self.rank}"
        sort = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=50, max_name_column_width=80)
        if self.device.type == "cuda":
            st = torch.cuda.memory_stats(self.device)
            keys = ("num_alloc_retries", "num_ooms", "reserved_bytes.all.peak", "allocated_bytes.all.peak")
            table += "\n" + " ".join(f"{k}={st.get(k, 0)}" for k in keys) + "\n"
        (out / f"{name}.txt").write_text(table)
        trace = out / f"{name}.json"
        prof.export_chrome_trace(str(trace))
        with trace.open("rb") as src, gzip.open(f"{trace}.gz", "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        logger.info("rank %d: profile of step %d written to %s", self.rank, self._prof_step, out)
