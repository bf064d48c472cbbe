"""benchmarks/cpu_accounting.py: processes are named by role, CPU is counted per step window, and a
window opens and closes on the rows of a metrics file."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from cpu_accounting import StepWindow, _label, cpu_by_label, format_table, snapshot  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def test_labels_name_roles_and_ray_processes():
    assert _label(1, "ray::ServeReplica:rollout:rollout") == "rollout"
    assert _label(1, "ray::EngineActor") == "engine"
    assert _label(1, "ray::TransferQueueController") == "tq_controller"
    assert _label(1, "ray::HeartbeatBoard") == "HeartbeatBoard"
    assert _label(1, "/x/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp") == "ray_daemons"
    assert _label(1, "/usr/bin/vim notes.txt") == "other"


def test_a_busy_process_is_counted_between_two_snapshots():
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(5)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        before = snapshot()
        time.sleep(1.0)
        after = snapshot()
    finally:
        child.kill()
        child.wait()
    assert after[child.pid][0] == "other"
    assert cpu_by_label({child.pid: before[child.pid]}, {child.pid: after[child.pid]})["other"] >= 0.2


def test_the_window_follows_the_metrics_rows(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    written: dict[int, float] = {}
    with StepWindow(metrics, first=2, last=4, poll_s=0.01) as window:
        for step in range(1, 6):
            written[step] = time.monotonic()
            with metrics.open("a") as f:
                f.write(json.dumps({"step": step}) + "\n")
            if step in (2, 4):  # the next row comes only once the window has marked this one
                marks = 1 if step == 2 else 2
                for _ in range(3000):
                    if len(window.marks) >= marks:
                        break
                    time.sleep(0.01)
    result = window.result()
    # opened at row 2 (not before it, not at row 3) and closed at row 4 (not before it, not at row 5)
    (opened, _), (closed, _) = window.marks
    assert written[2] <= opened < written[3] <= written[4] <= closed < written[5]
    assert result["wall_ms"] == pytest.approx(1e3 * (closed - opened) / 2)  # per step of the window
    assert result["driver"] >= 0 and result["total"] >= result["driver"]
    table = format_table({"mode": result})
    assert table.splitlines()[0].split() == ["CPU", "ms", "per", "step", "mode"]
    assert "utilisation" in table


def test_a_window_never_reached_gives_no_result(tmp_path):
    with StepWindow(tmp_path / "metrics.jsonl", first=1, last=3, poll_s=0.01) as window:
        time.sleep(0.05)
    assert window.result() == {}
    assert "no window" in format_table({"mode": {}})
    with pytest.raises(ValueError, match="last > first"):
        StepWindow(tmp_path / "m", first=3, last=3)
