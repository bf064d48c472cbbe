"""The agent endpoint inside a real training run (Ray Serve roles, the Rollout role's endpoint, embedded
engines over HTTP, one GRPO step): an external agent program runs every OpenAI check of
tests/openai_checks.py through the endpoint Relax hands it, and the step trains on its calls."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from relax.config import load_config
from relax.orchestration.controller import Controller

pytestmark = pytest.mark.slow

AGENT = Path(__file__).parents[1] / "agentic" / "agents" / "openai_agent.py"
NAMES = ["models", "chat", "stop", "seed", "n", "logprobs", "streaming", "tools", "stream_tool_calls",
         "response_format", "completions", "errors"]  # fmt: skip


def test_agent_endpoint_passes_the_openai_checks_in_a_training_run(
    ray_cluster, shared_engine, tiny_model_dir, arith_file, tmp_path
):
    out = tmp_path / "checks"
    out.mkdir()
    command = [sys.executable, str(AGENT), "--out", str(out / "{session_id}.json")]
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={tmp_path}",
            "run.name=agent-endpoint",
            "rollout.prompts_per_step=1",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=96",
            "rollout.agent.kind=external",
            f"rollout.agent.command={json.dumps(command)}",
            "rollout.agent.agent_timeout_s=600",
            "trainer.num_steps=1",
            "ops.progress=false",
            "schedule.data_plane=ray",  # spares TransferQueue's actors: not the subject (docs/testing.md)
            *shared_engine.overrides(),  # the session's engine server (tests/conftest.py)
            "ops.tensorboard=false",
            "resources.num_cpus=8",
        ],
    )
    assert Controller(cfg).run() == 1
    results = sorted(out.glob("*.json"))
    assert len(results) == 2, "both agents must finish every check (see the Rollout role's log)"
    for path in results:
        assert json.loads(path.read_text()) == NAMES
    row = json.loads((cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["step"] == 1 and "train/loss" in row
