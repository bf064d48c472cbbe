"""A short real run through Ray Serve: Controller -> Rollout (embedded engine over HTTP) -> Actor -> weight
sync, then resume from the checkpoint with the same step numbering."""

from __future__ import annotations

import json

import pytest

from relax.config import load_config
from relax.orchestration import checkpoint as ckpt
from relax.orchestration.controller import Controller

pytestmark = pytest.mark.slow

REQUIRED = [
    "step",
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "train/loss",
    "train/grad_norm",
    "perf/step_time_s",
    "weight_version",
]


def small_config(tiny_model_dir, arith_file, out_dir, steps, extra=()):
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={out_dir}",
            "run.name=e2e",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=4",
            f"trainer.num_steps={steps}",
            "ops.checkpoint_interval=2",
            "ops.progress=false",
            "resources.num_cpus=8",
            *extra,
        ],
    )


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_then_resume(ray_cluster, tiny_model_dir, arith_file, tmp_path):
    cfg = small_config(tiny_model_dir, arith_file, tmp_path, steps=3)
    assert Controller(cfg).run() == 3
    run_dir = cfg.run.run_dir
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in REQUIRED:
        assert key in rows[-1], key
    # Samples of step k come from weights v(k-1); after the update the engines report v(k).
    assert [r["weight_version"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/staleness_max"] == 0 for r in rows)
    assert rows[0]["train/rollout_logp_abs_diff_max"] < 1e-3  # engine and trainer agree (colocate, fp32)
    assert (run_dir / "config.yaml").exists()
    assert list((run_dir / "tensorboard").iterdir())
    assert ckpt.latest_checkpoint(run_dir)[0] == 3

    with pytest.raises(FileExistsError, match="--resume"):
        Controller(cfg).run()

    cfg2 = small_config(tiny_model_dir, arith_file, tmp_path, steps=5)
    assert Controller(cfg2, resume=True).run() == 5
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["weight_version"] == 5
    assert ckpt.latest_checkpoint(run_dir)[0] == 5
    saved = json.loads((ckpt.step_dir(run_dir, 5) / "rollout.json").read_text())
    assert saved["source"]["position"] == 5 * 4  # five steps of four prompts consumed


def test_train_a_model_named_by_its_hub_id_offline(
    ray_cluster, tiny_model_dir, arith_file, tmp_path, monkeypatch
):
    """`model.path: org/name` as verl and TRL configs write it, from a Hub cache with the network off."""
    from huggingface_hub import constants

    from tests.config.test_hub import COMMIT, build_hub_cache

    build_hub_cache(tmp_path / "hub", tiny_model_dir)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cfg = small_config("relax-test/tiny-qwen2", arith_file, tmp_path, steps=2)
    assert Controller(cfg).run() == 2
    assert [r["step"] for r in read_metrics(cfg.run.run_dir)] == [1, 2]
    recorded = (cfg.run.run_dir / "config.yaml").read_text()
    assert f"revision: {COMMIT}" in recorded and f"snapshots/{COMMIT}" in recorded
