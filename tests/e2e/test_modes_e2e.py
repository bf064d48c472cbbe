"""The three execution modes end to end: the toy config learns in colocate, hybrid and fully_async (each
with one of GRPO, PPO and GSPO; hybrid's checkpoints record the trained position); the staleness bound
holds with a slow trainer; max_staleness=0 is exactly on-policy."""

from __future__ import annotations

import json
import statistics

import pytest

from relax.config import load_config
from relax.orchestration import checkpoint as ckpt
from relax.orchestration.controller import Controller

pytestmark = pytest.mark.slow


def mode_config(tiny_model_dir, arith_file, out_dir, mode, steps, extra=()):
    return load_config(
        "tests/toy_arith.yaml",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arith_file}]",
            f"run.output_dir={out_dir}",
            f"run.name={mode}",
            f"schedule.mode={mode}",
            f"schedule.max_staleness={0 if mode == 'colocate' else 1}",
            f"trainer.num_steps={steps}",
            "ops.checkpoint_interval=0",
            "ops.progress=false",
            "ops.tensorboard=false",
            "eval.sets=[]",
            "eval.before_train=false",
            "rollout.engine_threads=1",
            "trainer.threads=1",
            "rollout.prompts_per_step=32",
            *extra,
        ],
    )


def tailed_data(arith_file, path, long_tokens):
    """The toy rows where every 4th may answer with `long_tokens` tokens (and is slow to score, see
    tests/e2e/reward_fns.py) and the rest with 2."""
    rows = [json.loads(line) for line in arith_file.read_text().splitlines()]
    with path.open("w") as fh:
        for i, row in enumerate(rows):
            long = i % 4 == 0
            meta = {"max_new_tokens": long_tokens if long else 2, "slow": long}
            fh.write(json.dumps({**row, "metadata": meta}) + "\n")
    return path


def read_metrics(cfg):
    return [json.loads(line) for line in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]


# Each mode learns with another algorithm, so three learning runs show every mode and the algorithms
# with a piece of their own learning: GRPO, PPO (the critic and GAE; fully_async has no critic role) and
# GSPO (sequence-level ratios). The other algorithms run end to end in tests/e2e/test_algorithms_e2e.py.
# hybrid's run also checks its checkpoints: hybrid generates ahead of training (partial rollouts on), and
# a checkpoint records the prompts trained, not those generated, so a resume (tests/e2e/test_train_e2e.py)
# draws the generated-ahead prompts again.
HYBRID_CHECKPOINTS = ["rollout.partial_rollout=true", "ops.checkpoint_interval=10"]


@pytest.mark.parametrize(
    ("mode", "algorithm"), [("colocate", "grpo"), ("hybrid", "ppo"), ("fully_async", "gspo")]
)
def test_mode_learns(ray_cluster, shared_engine, tiny_model_dir, arith_file, tmp_path, mode, algorithm):
    extra = [f"algorithm.name={algorithm}", *(HYBRID_CHECKPOINTS if mode == "hybrid" else [])]
    if mode != "colocate":  # colocate learns on its own embedded engine, the quickstart's path
        extra += shared_engine.overrides()  # the session's engine server (tests/conftest.py)
    if mode != "fully_async":
        # TransferQueue (the default plane) carries colocate in the quickstart run (test_train_e2e.py) and
        # hybrid in the completion-order run below; here it would only add its two actors (docs/testing.md)
        extra.append("schedule.data_plane=ray")
    cfg = mode_config(tiny_model_dir, arith_file, tmp_path, mode, steps=30, extra=extra)
    assert Controller(cfg).run() == 30
    rows = read_metrics(cfg)
    rewards = [r["rollout/reward_mean"] for r in rows]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    # tests/toy_arith.yaml on the 0.16 M model: over 30 steps the window means rise by 0.05-0.25
    assert last > first + 0.03, (mode, algorithm, rewards)
    assert max(r["staleness/max"] for r in rows) <= cfg.schedule.max_staleness
    assert all(r["rollout/engine_preempted"] == 0 for r in rows)  # the engines' counters reach the run
    if mode == "hybrid":  # ops.keep_checkpoints=2 keeps steps 20 and 30
        for step in (20, 30):
            source = json.loads((ckpt.step_dir(cfg.run.run_dir, step) / "rollout.json").read_text())["source"]
            drawn = source["epoch"] * source["num_rows"] + source["position"]  # the data wraps at 500 rows
            assert drawn == step * cfg.rollout.prompts_per_step, source


# 0 in CI: the exact on-policy edge (pi_old's ratio is 1). 2 in the full tier: every fully_async run in CI
# already asserts its staleness bound (the GSPO learning run at 1, in-place partial rollouts, the
# over-provisioned run), and 2 adds only that a slow trainer lets rollout use the whole budget.
@pytest.mark.parametrize("staleness", [0, pytest.param(2, marks=pytest.mark.full)])
def test_staleness_bound_with_slow_trainer(
    ray_cluster, shared_engine, tiny_model_dir, arith_file, tmp_path, staleness
):
    cfg = mode_config(
        tiny_model_dir,
        arith_file,
        tmp_path,
        "fully_async",
        steps=5,
        extra=[
            f"schedule.max_staleness={staleness}",
            "schedule.debug_train_delay_s=1.5",
            "schedule.data_plane=ray",
            *shared_engine.overrides(),  # the session's engine server (tests/conftest.py)
            # with staleness, pi_old is the behaviour policy: no ActorFwd, the Actor fills it in process
            *(["algorithm.old_log_probs=rollout"] if staleness else []),
        ],
    )
    assert Controller(cfg).run() == 5
    rows = read_metrics(cfg)
    assert all(("perf/actor_old_log_probs_s" in r) == bool(staleness) for r in rows)
    ahead = [r["staleness/rollout_ahead"] for r in rows]
    assert max(ahead) <= staleness
    assert max(r["staleness/max"] for r in rows) <= staleness
    assert max(r["rollout/staleness_max"] for r in rows) <= staleness
    if staleness == 0:  # exactly on-policy: ratio of current to old (and to behaviour) log-probs is 1
        assert all(r["staleness/first_mb_ratio_dev"] < 1e-4 for r in rows)
        assert all(r["staleness/first_mb_behaviour_ratio_dev"] < 1e-3 for r in rows)
    else:  # the slow trainer lets rollout use its whole budget
        assert max(ahead) == staleness


def test_in_place_partial_rollout_keeps_requests_across_updates(
    ray_cluster, tiny_model_dir, arith_file, tmp_path
):
    """fully_async with `partial_rollout_mode: in_place`: the embedded engine keeps generating through
    the weight pushes (nothing is aborted); samples that ran across a push record both versions, and the
    off-policy part is masked."""
    extra = [
        "rollout.partial_rollout=true",
        "rollout.partial_rollout_mode=in_place",
        "rollout.mask_offpolicy_tokens=true",
        "rollout.max_new_tokens=32",
        "rollout.prompts_per_step=8",
        "schedule.debug_engine_step_sleep_s=0.02",  # generation outlasts a training step: pushes land mid-way
        "schedule.data_plane=ray",  # spares TransferQueue's actors: not the subject (docs/testing.md)
    ]
    cfg = mode_config(tiny_model_dir, arith_file, tmp_path, "fully_async", steps=4, extra=extra)
    assert Controller(cfg).run() == 4
    metrics = read_metrics(cfg)
    assert all(r["rollout/aborted_requests"] == 0 for r in metrics), metrics
    assert sum(r["rollout/resumed_frac"] for r in metrics) > 0, [r["rollout/resumed_frac"] for r in metrics]
    assert max(r["staleness/max"] for r in metrics) <= 2


def test_completion_order_trains_long_groups_in_later_steps(
    ray_cluster, shared_engine, tiny_model_dir, arith_file, tmp_path
):
    """Every 4th prompt may answer with 48 tokens and is scored by a slow verifier, the rest answer with 2:
    under `batch_order: completion` the first steps fill with short groups (some drawn by the next step)
    and the long ones train later. The verifier's two seconds keep that order independent of how fast this
    machine decodes 46 tokens compared with one round trip of a request."""
    data = tailed_data(arith_file, tmp_path / "tailed.jsonl", long_tokens=48)
    extra = [
        f"data.train_files=[{data}]",
        "data.shuffle=false",
        "rollout.max_new_tokens=48",
        "rollout.prompts_per_step=16",
        "rollout.batch_order=completion",
        "rollout.partial_rollout=true",
        "rollout.max_aborts=8",
        "reward.name=tests.e2e.reward_fns:slow_on_long_rows",
        "reward.kwargs={delay_s: 2.0}",
        "reward.max_concurrency=256",  # the slow verifier does not queue the short groups behind it
        *shared_engine.overrides(),  # the session's engine server (tests/conftest.py)
    ]
    cfg = mode_config(tiny_model_dir, arith_file, tmp_path, "hybrid", steps=4, extra=extra)
    assert Controller(cfg).run() == 4
    metrics = read_metrics(cfg)
    assert [r["rollout/num_samples"] for r in metrics] == [16 * 8] * 4
    assert sum(r["rollout/carried_groups"] for r in metrics) > 0, metrics
    # step 1 fills with the 12 short groups it drew and 4 short ones drawn by step 2 (answers <= 2 tokens)
    assert metrics[0]["rollout/response_len_mean"] <= 2.0, metrics
    assert metrics[-1]["rollout/response_len_mean"] > 2.0, metrics


def test_over_provisioned_fully_async_on_cpu_budgets(
    ray_cluster, shared_engine, tiny_model_dir, arith_file, tmp_path
):
    """fully_async with `rollout.over_provision: 4` and the rollout and training roles pinned to CPU
    budgets: the first producer draws 12 prompts for a step of 8, so step 1 trains on the 8 short groups
    among them without waiting for the long ones (slow to score), which train in later steps; every step
    still trains on exactly 8 groups."""
    import os

    data = tailed_data(arith_file, tmp_path / "tailed.jsonl", long_tokens=24)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    extra = [
        f"data.train_files=[{data}]",
        "data.shuffle=false",
        "rollout.max_new_tokens=24",
        "rollout.prompts_per_step=8",
        "rollout.batch_order=completion",
        "rollout.over_provision=4",
        "rollout.partial_rollout=true",
        "rollout.max_aborts=8",
        "algorithm.old_log_probs=rollout",
        "reward.name=tests.e2e.reward_fns:slow_on_long_rows",
        "reward.kwargs={delay_s: 1.0}",
        "reward.max_concurrency=256",
        f"resources.rollout_cpus='{cpus[0]}'",
        f"resources.training_cpus='{cpus[-1]}'",
        *shared_engine.overrides(),  # the session's engine server (tests/conftest.py)
    ]
    cfg = mode_config(tiny_model_dir, arith_file, tmp_path, "fully_async", steps=4, extra=extra)
    assert Controller(cfg).run() == 4
    metrics = read_metrics(cfg)
    assert [r["rollout/num_samples"] for r in metrics] == [8 * 8] * 4
    assert metrics[0]["rollout/response_len_mean"] <= 2.0, metrics  # the 8 fastest of 12: all short
    assert sum(r["rollout/carried_groups"] for r in metrics) > 0, metrics
