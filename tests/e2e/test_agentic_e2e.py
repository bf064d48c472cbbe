"""The calculator-tool task through the whole system (Ray Serve roles, embedded engine, multi-turn
rollouts, GRPO): a randomly initialised tiny Qwen2 discovers the tool call, and the tool-use rate and
the reward rise within a short run."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from relax.agentic.tasks.calculator import generate_calc
from relax.config import load_config
from relax.orchestration.controller import Controller

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).parents[2] / "examples" / "calc_tool.yaml"


def test_calculator_tool_use_rises(ray_cluster, shared_engine, tiny_model_dir, tmp_path):
    data = generate_calc(tmp_path / "calc.jsonl", n=1000)
    steps = 16
    cfg = load_config(
        str(EXAMPLE),
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{data}]",
            f"run.output_dir={tmp_path}",
            f"trainer.num_steps={steps}",
            "ops.tensorboard=false",
            "schedule.data_plane=ray",  # spares TransferQueue's actors: not the subject (docs/testing.md)
            *shared_engine.overrides(),  # the session's engine server (tests/conftest.py)
            "resources.num_cpus=8",
        ],
    )
    assert Controller(cfg).run() == steps
    rows = [json.loads(x) for x in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    use = [r["agent/tool_use_rate"] for r in rows]
    reward = [r["rollout/reward_mean"] for r in rows]
    first, last = slice(0, 3), slice(-3, None)
    print("tool_use_rate", [round(u, 3) for u in use])
    print("reward_mean", [round(x, 3) for x in reward])
    assert statistics.fmean(use[last]) > statistics.fmean(use[first]) + 0.1
    assert statistics.fmean(reward[last]) > 2 * statistics.fmean(reward[first]) + 0.005
    assert all(r["train/rollout_logp_abs_diff_max"] < 1e-3 for r in rows)  # masks and log-probs line up
