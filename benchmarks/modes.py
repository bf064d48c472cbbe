"""Throughput of the execution modes on one workload: colocate vs hybrid vs fully_async.

The workload is the arithmetic toy task with a long-tailed response-length distribution: each prompt
row carries its own response cap (`metadata.max_new_tokens`), drawn from a Pareto distribution (most
groups stop after a few tokens, a few run to the global cap), so a step's rollout waits for its
slowest groups. Rollout and training get separate CPU budgets: by default (`--budgets pinned`) the
rollout side (engine, Rollout, Advantages) is pinned to the first half of the host's CPUs and the
training side (Actor, ActorFwd, Reference) to the second half (`resources.rollout_cpus`,
`resources.training_cpus`), each with one torch thread (`rollout.engine_threads`, `trainer.threads`).
Colocate alternates between the budgets, the other modes overlap them within the staleness bound.
`--budgets threads` leaves the processes unpinned: only the torch thread counts are separate, and each
side's Python work spills onto the other's cores.

    python benchmarks/modes.py --steps 20 --max-staleness 1

prints steps per minute per mode (steady state: the first `--warmup` steps are left out), the ratio to
colocate, and the first/last reward window means. This machine's speed drifts by 10-15% between runs,
so `--repeats N` runs the modes N times in turn (colocate, hybrid, fully_async, colocate, ...) and
reports the median steps/min per mode, the ratio of the medians, and each round's ratio to the colocate
run beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from async_flags import add_async_flags
from cpu_accounting import StepWindow, format_table

logger = logging.getLogger(__name__)


def long_tailed_data(path: Path, n: int, cap: int, alpha: float, seed: int) -> Path:
    """Arithmetic rows with a Pareto(alpha)-distributed response cap in [2, cap] tokens."""
    from relax.data.toy import generate_arith

    generate_arith(path, n=n, seed=seed)
    rng = random.Random(seed)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r.setdefault("metadata", {})["max_new_tokens"] = int(min(cap, 2 * rng.paretovariate(alpha)))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def budget_overrides(budgets: str) -> list[str]:
    """`pinned`: rollout on the first half of the CPUs this process may use, training on the rest."""
    if budgets == "threads":
        return []
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--budgets pinned needs 2 or more CPUs; use --budgets threads")
    half = len(cpus) // 2
    rollout, training = cpus[:half], cpus[half:]
    return [
        f"resources.rollout_cpus='{','.join(map(str, rollout))}'",
        f"resources.training_cpus='{','.join(map(str, training))}'",
    ]


def run_mode(mode: str, args: argparse.Namespace, model: Path, data: Path, out: Path) -> dict[str, float]:
    from relax.config import load_config
    from relax.orchestration.controller import Controller

    staleness = 0 if mode == "colocate" else args.max_staleness
    cfg = load_config(
        "examples/quickstart.yaml",
        [
            f"model.path={model}",
            f"data.train_files=[{data}]",
            f"run.output_dir={out}",
            f"run.name={mode}",
            f"schedule.mode={mode}",
            f"schedule.max_staleness={staleness}",
            f"schedule.data_plane={args.data_plane}",
            f"trainer.num_steps={args.steps}",
            f"rollout.max_new_tokens={args.cap}",
            f"rollout.engine_threads={args.engine_threads}",
            f"trainer.threads={args.trainer_threads}",
            f"rollout.partial_rollout={str(args.partial_rollout).lower()}",
            f"rollout.batch_order={'step' if mode == 'colocate' else args.batch_order}",
            f"rollout.max_aborts={args.max_aborts}",
            f"rollout.partial_rollout_mode={args.partial_mode}",
            f"rollout.over_provision={0 if mode == 'colocate' else args.over_provision}",
            f"algorithm.old_log_probs={args.old_log_probs}",
            "ops.checkpoint_interval=0",
            "ops.progress=false",
            "ops.tensorboard=false",
            f"rollout.prompts_per_step={args.prompts}",
            "eval.sets=[]",
            "eval.before_train=false",
            *budget_overrides(args.budgets),
            *args.set,
        ],
    )
    window = StepWindow(cfg.run.run_dir / "metrics.jsonl", args.warmup, args.steps - 1) if args.cpu else None
    t0 = time.perf_counter()
    with window or contextlib.nullcontext():
        Controller(cfg).run()
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[args.warmup :]
    seconds = sum(r["perf/step_time_s"] for r in steady)
    rewards = [r["rollout/reward_mean"] for r in rows]
    w = max(1, min(5, len(rewards) // 3))
    return {
        "steps_per_min": 60.0 * len(steady) / seconds,
        "wall_s": wall,
        "reward_first": statistics.fmean(rewards[:w]),
        "reward_last": statistics.fmean(rewards[-w:]),
        "response_len_mean": statistics.fmean(r["rollout/response_len_mean"] for r in rows),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
        "cpu": window.result() if window else {},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="colocate,hybrid,fully_async")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of steps/min")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--cap", type=int, default=32, help="global response cap (tokens)")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (8 samples each)")
    p.add_argument("--alpha", type=float, default=1.2, help="Pareto tail index of the per-row caps")
    p.add_argument("--hidden-size", type=int, default=64, help="of the tiny Qwen2 (the quickstart's has 256)")
    p.add_argument("--engine-threads", type=int, default=1)
    p.add_argument("--trainer-threads", type=int, default=1)
    p.add_argument("--data-plane", default="transferqueue", choices=["transferqueue", "ray"])
    p.add_argument(
        "--budgets",
        choices=["pinned", "threads"],
        default="pinned",
        help="separate CPU budgets: pinned CPU sets (default) or only torch thread counts",
    )
    p.add_argument(
        "--over-provision",
        type=int,
        default=0,
        help="hybrid/fully_async with --batch-order completion: groups kept in flight beyond the steps' "
        "(rollout.over_provision)",
    )
    p.add_argument("--set", action="append", default=[], help="extra config override key=value (repeatable)")
    p.add_argument("--partial-rollout", action="store_true")
    add_async_flags(p, batch_order="step", max_aborts=2)
    p.add_argument("--ray-cpus", type=int, default=8, help="logical CPUs declared to Ray")
    p.add_argument("--repeats", type=int, default=1, help="rounds of all modes, run in turn")
    p.add_argument(
        "--cpu", action="store_true", help="also print each process's CPU ms per step (Linux /proc)"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from relax.models.tiny import write_tiny_model
    from relax.orchestration.service import start_ray

    tmp = Path(tempfile.mkdtemp(prefix="relax-modes-"))
    model = write_tiny_model(tmp / "tiny-qwen2", family="qwen2", hidden_size=args.hidden_size)
    data = long_tailed_data(tmp / "arith.jsonl", n=2000, cap=args.cap, alpha=args.alpha, seed=0)
    start_ray(None, num_cpus=args.ray_cpus, object_store_mb=1024)
    modes = args.modes.split(",")
    rounds = [
        {m: run_mode(m, args, model, data, tmp / f"runs-{k}") for m in modes} for k in range(args.repeats)
    ]
    print(
        f"\nmodes benchmark: {args.steps} steps, max_staleness={args.max_staleness}, cap={args.cap}, "
        f"engine_threads={args.engine_threads}, trainer_threads={args.trainer_threads}, "
        f"budgets={args.budgets} {budget_overrides(args.budgets)}, {args.set or ''}\n"
        f"data_plane={args.data_plane}, partial_rollout={args.partial_rollout} ({args.partial_mode}), "
        f"batch_order={args.batch_order}, over_provision={args.over_provision}, old_log_probs={args.old_log_probs}, repeats={args.repeats}"
    )
    print(
        f"{'mode':<12} {'steps/min':>9} {'x colocate':>10} {'per round':>16} {'reward first':>12} "
        f"{'reward last':>11} {'resp len':>8} {'stale max':>9}"
    )
    base = statistics.median(r["colocate"]["steps_per_min"] for r in rounds) if "colocate" in modes else None
    for mode in modes:
        runs = [r[mode] for r in rounds]
        speed = statistics.median(x["steps_per_min"] for x in runs)
        ratio = f"{speed / base:.2f}" if base else "-"
        per_round = (
            ",".join(f"{r[mode]['steps_per_min'] / r['colocate']['steps_per_min']:.2f}" for r in rounds)
            if base
            else "-"
        )
        print(
            f"{mode:<12} {speed:>9.1f} {ratio:>10} {per_round:>16} "
            f"{statistics.fmean(x['reward_first'] for x in runs):>12.3f} "
            f"{statistics.fmean(x['reward_last'] for x in runs):>11.3f} "
            f"{statistics.fmean(x['response_len_mean'] for x in runs):>8.1f} "
            f"{max(x['staleness_max'] for x in runs):>9.0f}"
        )

    if args.cpu:  # the mean over rounds of each process's CPU per counted step
        cpu = {}
        for mode in modes:
            runs = [r[mode]["cpu"] for r in rounds if r[mode]["cpu"]]
            keys = {k for run in runs for k in run}
            cpu[mode] = {k: statistics.fmean(run.get(k, 0.0) for run in runs) for k in keys} if runs else {}
        print(f"\n{format_table(cpu)}")


if __name__ == "__main__":
    main()
