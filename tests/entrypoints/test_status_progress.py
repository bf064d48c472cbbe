"""`relax status` reads what the metrics service really writes (the step time of the Controller's phases,
each row's wall-clock time), and `relax eval`'s progress follows the evaluator's progress file."""

from __future__ import annotations

import json
import time

from relax.config import load_config
from relax.entrypoints.cli import main
from relax.ops.trace import StepPhases
from relax.orchestration.eval_only import _with_progress
from relax.roles.metrics import MetricsRole
from relax.rollout.evaluator import EvalProgress, read_progress


def test_status_shows_the_step_time_and_the_rows_time(tiny_model_dir, arith_file, tmp_path, capsys):
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            "run.name=st",
            "ops.tensorboard=false",
        ],
    )
    role = MetricsRole(cfg)
    before = time.time()
    phases = StepPhases()
    with phases.phase("step_time"):  # what the Controller measures a step with
        time.sleep(0.05)
    role.flush(1, {"rollout/reward_mean": 0.5, **phases.times}, phases.spans)
    role.close()
    row = json.loads((cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert before <= row["time"] <= time.time()  # every row carries its wall-clock time

    assert main(["status", str(cfg.run.run_dir), "--json", "--timeout", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step"] == 1
    assert data["step_time_s"] == phases.times["perf/step_time_s"] and data["step_time_s"] >= 0.05
    assert 0 <= data["metrics_age_s"] < 60
    assert main(["status", str(cfg.run.run_dir), "--timeout", "1"]) == 0
    assert "step time 0.0" in capsys.readouterr().out


def test_eval_progress_file_and_bar(tmp_path, capsys):
    path = tmp_path / "progress.json"
    assert read_progress(path) is None
    progress = EvalProgress(path, total=5, interval_s=0.0)

    def evaluate() -> str:  # stands in for the Rollout role's evaluate call
        for name in ("a", "b"):
            progress.start_set(name)
            for _ in range(2 if name == "a" else 3):
                time.sleep(0.05)
                progress.tick()
        return "metrics"

    assert _with_progress(evaluate, path, enabled=True, poll_s=0.02) == "metrics"
    assert read_progress(path) == {"done": 5, "total": 5, "set": "b"}
    err = capsys.readouterr().err
    assert "eval" in err and "5/5" in err  # the bar reached the end


def test_eval_progress_reraises_the_failure(tmp_path):
    def fails() -> None:
        raise RuntimeError("engine gone")

    try:
        _with_progress(fails, tmp_path / "progress.json", enabled=False, poll_s=0.01)
    except RuntimeError as e:
        assert "engine gone" in str(e)
    else:
        raise AssertionError("the failure was swallowed")
