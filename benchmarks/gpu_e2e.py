"""End-to-end GPU benchmark: `relax train` with a random model of Qwen2.5-0.5B's shape in bf16, in
colocate, hybrid and fully_async modes on the same GPUs and the same workload.

Workload: prompts of mixed length (32-512 tokens), GRPO with 8 samples per prompt, responses with a
long-tailed length distribution (each row's cap drawn from a Pareto law, up to `--cap` tokens; a random
model rarely stops by itself, so the caps set the lengths), and the synthetic `token_rate` reward
(share of response token ids divisible by 8; random sampling gives ~1/8, learning raises it).

Placement on G GPUs (relax/orchestration/gpus.py): colocate puts one training rank and one engine on
every GPU (they take turns); hybrid and fully_async give the engines G/2 GPUs and the trainer the rest
(fully_async adds the ActorFwd role beside the trainer). hybrid and fully_async run with partial rollout
(a weight push aborts in-flight requests, which resume under the new weights) unless
`--no-partial-rollout`: the next step's prompts already fill the engines while a step's tail decodes, and
a push that waited for them would wait for that tail too.

    python benchmarks/gpu_e2e.py --steps 8                      # on a 2-GPU host
    python benchmarks/gpu_e2e.py --tiny --steps 3 --cap 16      # CPU smoke run with a tiny model

prints, per mode: steps/min (steady state, the first `--warmup` steps left out), generated tokens/s,
trainer MFU (6 N tokens / update time / peak x ranks), weight-sync time per step (publish = gather +
broadcast on the trainer; sync = the whole pause/push/resume), peak GPU memory per device (nvidia-smi,
all processes), first/last reward, and the ratio of steps/min to colocate.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from async_flags import add_async_flags

PEAK_FLOPS = 989e12  # H200 dense bf16, the public datasheet basis
QWEN25_05B = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936}  # fmt: skip
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud light".split()


def write_data(path: Path, n: int, cap: int, alpha: float, seed: int) -> Path:
    """Rows of 32-512 random words with a Pareto(alpha) response cap in [16, cap] tokens."""
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            words = rng.randint(16, 256)  # about 2 tokens a word with the small tokenizer
            prompt = " ".join(rng.choice(WORDS) for _ in range(words))
            max_new = int(min(cap, 16 * rng.paretovariate(alpha)))
            fh.write(
                json.dumps({"prompt": prompt, "label": "", "metadata": {"max_new_tokens": max_new}}) + "\n"
            )
    return path


class GpuMemoryPeak:
    """Polls nvidia-smi in a thread; `peaks` holds the highest memory.used (MiB) seen per GPU."""

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.peaks: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10, check=True,
                ).stdout  # fmt: skip
                used = [int(x) for x in out.split()]
                self.peaks = (
                    [max(a, b) for a, b in zip(self.peaks, used, strict=True)] if self.peaks else used
                )
            except (OSError, subprocess.SubprocessError, ValueError):
                return  # no GPU tool: nothing to report
            self._stop.wait(self.interval_s)

    def __enter__(self) -> GpuMemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


# Variants run under their own name: a mode plus overrides.
VARIANTS = {"colocate-p2p": ("colocate", ["trainer.ranks_see_all_gpus=true"])}
# `<mode>-compiled`: the mode with torch.compile'd decoder layers on the training ranks
VARIANTS.update(
    {f"{m}-compiled": (m, ["trainer.compile_layers=true"]) for m in ("colocate", "hybrid", "fully_async")}
)


def baseline(name: str, results: dict[str, dict]) -> float | None:
    """steps/min of the colocate run a mode compares against: the same variant's when it ran."""
    suffix = name.split("-", 1)[1] if "-" in name else ""
    for key in ([f"colocate-{suffix}"] if suffix else []) + ["colocate", "colocate-p2p"]:
        if key in results:
            return results[key]["steps_per_min"]
    return None


def run_mode(name: str, args: argparse.Namespace, model: Path, data: Path, out: Path, gpus: int) -> dict:
    from relax.config import load_config
    from relax.orchestration.controller import Controller

    mode, extra = VARIANTS.get(name, (name, []))
    split = mode != "colocate"
    engines = max(1, gpus // 2) if split and gpus else max(1, gpus)
    ranks = max(1, gpus - engines) if split and gpus else max(1, gpus)
    overrides = [
        f"model.path={model}", f"model.dtype={args.dtype}", f"data.train_files=[{data}]",
        "data.apply_chat_template=false", "data.max_prompt_len=2048",
        f"run.output_dir={out}", f"run.name={name}", f"run.seed={args.seed}",
        f"schedule.mode={mode}", f"schedule.max_staleness={0 if mode == 'colocate' else args.max_staleness}",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.max_new_tokens={args.cap}", f"rollout.num_engines={engines}",
        "rollout.temperature=1.0", "reward.name=token_rate", "algorithm.name=grpo", "algorithm.kl_coef=0.0",
        "algorithm.entropy_coef=0.0", f"algorithm.old_log_probs={args.old_log_probs}", f"trainer.num_steps={args.steps}", f"trainer.lr={args.lr}",
        "trainer.backend=fsdp", f"trainer.num_ranks={ranks}", f"trainer.max_tokens_per_micro_batch={args.mb_tokens}",
        f"trainer.gradient_checkpointing={str(args.grad_ckpt).lower()}",
        "ops.checkpoint_interval=0", "ops.progress=false", "ops.tensorboard=false", "ops.log_interval=1",
        "eval.sets=[]", f"rollout.partial_rollout={str(split and args.partial_rollout).lower()}",
        f"rollout.batch_order={args.batch_order if split else 'step'}", f"rollout.max_aborts={args.max_aborts}", f"rollout.partial_rollout_mode={args.partial_mode}",
    ]  # fmt: skip
    cfg = load_config(args.base_config, [*overrides, *extra, *args.set])
    with GpuMemoryPeak() as mem:
        t0 = time.perf_counter()
        Controller(cfg).run()
        wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (cfg.run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[args.warmup :] or rows
    step_s = sum(r["perf/step_time_s"] for r in steady)
    gen_tokens = sum(r["rollout/num_samples"] * r["rollout/response_len_mean"] for r in steady)
    trained = [
        r["rollout/num_samples"] * (r["rollout/prompt_len_mean"] + r["rollout/response_len_mean"])
        for r in steady
    ]
    update_s = [r.get("perf/actor_update_s", float("nan")) for r in steady]
    n_params = _param_count(model)
    mfu = statistics.fmean(
        6 * n_params * t / u / (PEAK_FLOPS * ranks) for t, u in zip(trained, update_s, strict=True)
    )
    rewards = [r["rollout/reward_mean"] for r in rows]
    w = max(1, min(3, len(rewards) // 3))
    return {
        "engines": engines, "ranks": ranks, "wall_s": wall, "metrics": str(cfg.run.run_dir / "metrics.jsonl"),
        "steps_per_min": 60.0 * len(steady) / step_s,
        "gen_tok_s": gen_tokens / step_s,
        "mfu": mfu if gpus else float("nan"),
        "publish_s": statistics.fmean(r.get("perf/weight_publish_s", float("nan")) for r in steady),
        "sync_s": statistics.fmean(r.get("perf/weight_sync_s", float("nan")) for r in steady),
        "sync_backend": cfg.trainer.weight_sync_backend,
        "mem_peak_mib": mem.peaks,
        "resp_len": statistics.fmean(r["rollout/response_len_mean"] for r in rows),
        "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
        "carried_groups": sum(r.get("rollout/carried_groups", 0.0) for r in rows),
        "reward_first": statistics.fmean(rewards[:w]), "reward_last": statistics.fmean(rewards[-w:]),
    }  # fmt: skip


def _param_count(model: Path) -> int:
    from safetensors import safe_open

    n = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                n += _prod(st.get_slice(k).get_shape())
    return n


def _prod(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--modes",
        default="colocate,fully_async,hybrid",
        help=f"modes to run in turn; also the variants {sorted(VARIANTS)} (a mode plus overrides)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override, every mode"
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the rates")
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--cap", type=int, default=1024, help="response cap (tokens)")
    p.add_argument("--alpha", type=float, default=1.0, help="Pareto tail index of the per-row caps")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--mb-tokens", type=int, default=32768, help="trainer tokens per micro-batch")
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument(
        "--partial-rollout",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hybrid/fully_async: a weight push aborts in-flight requests, which resume under the new "
        "weights (otherwise the push waits for them, and the next step's tail with them)",
    )
    add_async_flags(p, batch_order="completion", max_aborts=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    p.add_argument("--base-config", default="examples/quickstart.yaml")
    p.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("relax.orchestration.gpus").setLevel(logging.INFO)

    from relax.models.tiny import write_tiny_model
    from relax.models.tokenizer import train_tiny_tokenizer
    from relax.orchestration.gpus import cluster_gpus
    from relax.orchestration.service import start_ray

    tmp = Path(args.out or tempfile.mkdtemp(prefix="relax-gpu-e2e-"))
    tmp.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.tiny:
        model = write_tiny_model(tmp / "model", family="qwen2", dtype="float32")
        args.dtype = "float32"
    else:
        dims = {k: v for k, v in QWEN25_05B.items()}
        model = write_tiny_model(tmp / "model", family="qwen2", tokenizer=train_tiny_tokenizer(4096),
                                 dtype=args.dtype, **dims)  # fmt: skip
    data = write_data(tmp / "prompts.jsonl", n=4000, cap=args.cap, alpha=args.alpha, seed=args.seed)
    print(f"model {_param_count(model) / 1e6:.1f} M parameters written in {time.perf_counter() - t0:.0f}s")
    start_ray(None, num_cpus=32, object_store_mb=8192)
    gpus = cluster_gpus()
    results = {}
    for mode in args.modes.split(","):
        results[mode] = run_mode(mode, args, model, data, tmp / "runs", gpus)
        print(f"{mode}: {json.dumps(results[mode])}", flush=True)
        print(f"  per-step metrics: {results[mode]['metrics']}", flush=True)
    print(f"\nGPU e2e: {gpus} GPUs, {args.steps} steps ({args.warmup} warm-up), {args.prompts}x{args.n} "
          f"samples/step, cap {args.cap}, max_staleness {args.max_staleness}, partial_rollout {args.partial_rollout} ({args.partial_mode}), "
          f"batch_order {args.batch_order}, old_log_probs {args.old_log_probs}")  # fmt: skip
    head = (f"{'mode':<21}{'eng':>4}{'rk':>3}{'steps/min':>10}{'x coloc':>8}{'gen tok/s':>10}{'MFU':>7}"
            f"{'publish s':>10}{'sync s':>8}{'backend':>8}{'resp len':>9}{'reward':>14}  mem peak MiB")  # fmt: skip
    print(head)
    for mode, r in results.items():
        base = baseline(mode, results)
        ratio = f"{r['steps_per_min'] / base:.2f}" if base else "-"
        print(f"{mode:<21}{r['engines']:>4}{r['ranks']:>3}{r['steps_per_min']:>10.2f}{ratio:>8}{r['gen_tok_s']:>10.0f}"
              f"{r['mfu']:>7.1%}{r['publish_s']:>10.3f}{r['sync_s']:>8.3f}{r['sync_backend']:>8}{r['resp_len']:>9.0f}"
              f"{r['reward_first']:>7.3f}->{r['reward_last']:.3f}  {r['mem_peak_mib']}")  # fmt: skip


if __name__ == "__main__":
    main()
