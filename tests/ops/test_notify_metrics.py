"""Notifications reach an HTTP endpoint on 127.0.0.1 through Apprise's json:// scheme; the Metrics service
writes JSONL, TensorBoard (read back with tensorboard's own reader), a W&B offline run and a Chrome trace."""

from __future__ import annotations

import json

import pytest
from inbox import Inbox

from relax.config import load_config
from relax.ops.notify import Notifier
from relax.ops.trace import StepPhases, read_trace
from relax.roles.metrics import MetricsRole


@pytest.fixture
def inbox():
    box = Inbox()
    yield box
    box.close()


def test_notifications_delivered_over_http(inbox):
    n = Notifier([inbox.url], "demo")
    n.run_started(0, 10, "colocate")
    try:
        raise ValueError("boom in the trainer")
    except ValueError as e:
        n.failure("role actor", e)
    n.restart("global", "restart 1 of 2")
    n.run_ended(10, {"rollout/reward_mean": 0.5})
    titles = [b["title"] for b in inbox.bodies]
    assert titles == [
        "[relax demo] run started",
        "[relax demo] failure: role actor",
        "[relax demo] restart: global",
        "[relax demo] run finished",
    ]
    assert "boom in the trainer" in inbox.bodies[1]["message"]
    assert "Traceback" in inbox.bodies[1]["message"]  # the traceback travels with the failure
    assert inbox.bodies[1]["type"] == "failure"
    assert "rollout/reward_mean: 0.5" in inbox.bodies[3]["message"]


def test_bad_notify_url_is_refused():
    with pytest.raises(ValueError, match="notify_urls"):
        Notifier(["definitely-not-a-scheme://x"], "demo")


def test_unreachable_endpoint_does_not_raise():
    n = Notifier(["json://127.0.0.1:9/nothing-listens-here"], "demo")
    assert n.send("hello", "world") is False


def _cfg(tiny_model_dir, arith_file, tmp_path, *extra):
    return load_config(
        "tests/toy_arith.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            "run.name=m",
            *extra,
        ],
    )


def test_metrics_service_sinks(tiny_model_dir, arith_file, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _cfg(
        tiny_model_dir,
        arith_file,
        tmp_path,
        "ops.wandb={mode: offline, project: relax-test}",
        "ops.trace=true",
    )
    role = MetricsRole(cfg)
    for step in (1, 2, 3):
        phases = StepPhases()
        with phases.phase("step_time"):
            with phases.phase("rollout"):
                pass
            with phases.phase("train"):
                pass
        role.report(step, {"health/role_restarts": float(step - 1)})  # a role's report joins the step
        role.flush(step, {"rollout/reward_mean": step / 10, **phases.times}, phases.spans)
    role.close()
    run_dir = cfg.run.run_dir

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["health/role_restarts"] for r in rows] == [0.0, 1.0, 2.0]

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("rollout/reward_mean")
    assert [(e.step, round(e.value, 6)) for e in events] == [(1, 0.1), (2, 0.2), (3, 0.3)]

    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run_dir / "wandb").iterdir())
    (log,) = offline[0].glob("run-*.wandb")
    assert b"rollout/reward_mean" in log.read_bytes()

    trace = read_trace(run_dir / "trace.json")
    assert [e["args"]["step"] for e in trace if e["name"] == "rollout"] == [1, 2, 3]
    for e in trace:
        assert e["ph"] == "X" and e["dur"] >= 0
    outer = [e for e in trace if e["name"] == "step_time"]
    inner = [e for e in trace if e["name"] == "train"]
    for o, i in zip(outer, inner, strict=True):  # the phases nest inside the step on the timeline
        assert o["ts"] <= i["ts"] and i["ts"] + i["dur"] <= o["ts"] + o["dur"] + 1


def test_metrics_resume_sets_aside_redone_steps(tiny_model_dir, arith_file, tmp_path):
    cfg = _cfg(tiny_model_dir, arith_file, tmp_path, "ops.tensorboard=false")
    role = MetricsRole(cfg)
    for step in (1, 2, 3):
        role.flush(step, {"x": float(step)})
    role.close()
    role = MetricsRole(cfg, resume_step=2)  # a global restart from the checkpoint of step 2
    role.flush(3, {"x": 30.0})
    role.close()
    rows = [json.loads(line) for line in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    superseded = (cfg.run.run_dir / "metrics.superseded.jsonl").read_text().splitlines()
    assert [json.loads(line)["x"] for line in superseded] == [3.0]


def test_tensorboard_after_a_resume_keeps_one_point_per_step_and_no_torch(tmp_path):
    """A resumed attempt writes again the steps after its checkpoint: TensorBoard shows each step once,
    with the new attempt's value. The sink does not import torch (the Metrics replica needs none)."""
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from relax.ops.metric_sinks import TensorBoardSink

    log_dir = tmp_path / "tensorboard"
    first = TensorBoardSink(log_dir)
    for step in (1, 2, 3, 4):
        first.log(step, {"loss": float(step), "done": True})
    first.close()
    second = TensorBoardSink(log_dir, resume_step=2)  # resumed from the checkpoint of step 2
    for step in (3, 4, 5):
        second.log(step, {"loss": 10.0 * step})
    second.close()
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (4, 40.0),
        (5, 50.0),
    ]
    assert [e.value for e in acc.Scalars("done")] == [1.0, 1.0]  # the first attempt's steps 1 and 2

    probe = "import sys; from relax.ops.metric_sinks import TensorBoardSink; " + (
        f"TensorBoardSink(__import__('pathlib').Path({str(tmp_path / 'p')!r})).log(1, {{'x': 1.0}}); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
