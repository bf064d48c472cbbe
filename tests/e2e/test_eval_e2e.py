"""Evaluation during a short run writes eval metrics and response samples; `relax eval` on the saved
checkpoint reproduces the in-run figures under greedy decoding."""

from __future__ import annotations

import json

import pytest

from relax.config import load_config
from relax.orchestration import checkpoint as ckpt
from relax.orchestration.controller import Controller
from relax.orchestration.eval_only import run_eval

pytestmark = pytest.mark.slow


def test_eval_in_run_and_eval_only(ray_cluster, shared_engine, tiny_model_dir, arith_file, tmp_path):
    overrides = [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{arith_file}]",
        f"run.output_dir={tmp_path}",
        "run.name=ev",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "trainer.num_steps=2",
        "trainer.lr=1e-2",
        "ops.progress=false",
        "schedule.data_plane=ray",  # spares TransferQueue's actors: not the subject (docs/testing.md)
        *shared_engine.overrides(),  # the session's engine server (tests/conftest.py)
        "eval.interval=1",
        "eval.before_train=true",
        f"eval.sets=[{{name: arith, files: [{arith_file}], max_prompts: 12, n_samples_per_prompt: 2, "
        "k_values: [1, 2], temperature: 0.0, save_samples: 5}]",
    ]
    cfg = load_config(None, overrides)
    Controller(cfg).run()
    run_dir = cfg.run.run_dir
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert set(rows) == {0, 1, 2}
    for step in (0, 1, 2):
        for key in (
            "reward_mean",
            "pass@1",
            "pass@2",
            "mean@1",
            "mean@2",
            "response_len_mean",
            "truncated_frac",
        ):
            assert f"eval/arith/{key}" in rows[step], (step, key)
        saved = (run_dir / "eval" / "arith" / f"step_{step:06d}.jsonl").read_text().splitlines()
        assert len(saved) == 5 and "response" in json.loads(saved[0])
    assert rows[2]["eval/arith/num_prompts"] == 12
    # Eval never touches the training stream: 2 steps x 4 prompts consumed.
    step, path = ckpt.latest_checkpoint(run_dir)
    assert json.loads((path / "rollout.json").read_text())["source"]["position"] == 8

    cfg2 = load_config(None, overrides)
    again = run_eval(cfg2, str(path))
    for key in ("reward_mean", "pass@1", "response_len_mean"):
        assert again[f"eval/arith/{key}"] == pytest.approx(rows[step][f"eval/arith/{key}"]), key
    assert (run_dir / "eval_only" / "metrics.jsonl").exists()
    # what `relax eval`'s progress bar followed, at its end
    progress = json.loads((run_dir / "eval_only" / "progress.json").read_text())
    assert progress == {"done": 12, "total": 12, "set": "arith"}
