"""One RL step on one GPU through the real `relax train` path (Controller, Ray Serve roles, the embedded
engine, one FSDP2 training rank): where a step's time goes, and how fast the in-run training is.

Workload (issue 38): a random model of a preset's shape with the small in-process tokenizer, colocate
(engine and trainer take turns on the GPU), GRPO, `--prompts` prompts of 16-64 words x `--n` samples,
`--new-tokens` new tokens (a random model rarely stops early), the synthetic `token_rate` reward, bf16
engine, bf16 compute over fp32 master weights. Every trainer knob is left at its default unless
`--set` says otherwise.

    python benchmarks/rl_step.py --preset qwen2.5-0.5b
    python benchmarks/rl_step.py --preset qwen2.5-1.5b --steps 8
    python benchmarks/rl_step.py --preset qwen2.5-3b --steps 6
    python benchmarks/rl_step.py --preset tiny --device cpu --steps 3       # a CPU smoke run

Prints per-phase seconds (medians over the steps after `--warmup`, from metrics.jsonl), tokens per step,
MFU of the forward (2 N tokens / forward seconds) and of the update (6 N tokens / update seconds; 989
TFLOP/s, the H200's public dense bf16 peak), the trainer's peak and reserved memory and the GPU's used memory over
the steps, the numerics (loss, engine-vs-trainer log-prob gap), and writes a torch-profiler trace of one
step of the training rank (`--profile-step`) and the run's phase trace under `--out`. The last line is
one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

PEAK_FLOPS = 989e12  # H200 dense bf16, the public datasheet basis
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud light".split()
# Qwen2.5 shapes (tied embeddings, vocabulary 151936); `tiny` is a CPU smoke shape
PRESETS = {
    "qwen2.5-0.5b": dict(
        hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960
    ),
    "qwen2.5-3b": dict(
        hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2, intermediate_size=11008
    ),
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256),
}
PHASES = [  # (name printed, metric)
    ("step", "perf/step_time_s"),
    ("rollout", "perf/rollout_s"),
    ("  engine busy", "rollout/engine_busy_s"),  # inside the engine's steps; the rest is around them
    ("train (Actor call)", "perf/train_s"),
    ("  old log-probs", "perf/actor_old_log_probs_s"),
    ("  rank forward", "perf/rank_forward_s"),
    ("  update", "perf/actor_update_s"),
    ("  rank update", "perf/rank_update_s"),
    ("weight sync", "perf/weight_sync_s"),
]


def write_data(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 64)))
            fh.write(json.dumps({"prompt": prompt, "label": ""}) + "\n")
    return path


class MemoryWatch:
    """Polls nvidia-smi (every process on the GPU) and the number of steps in metrics.jsonl, so the
    used memory can be read per step: `used_at[k]` is the largest used MiB seen while step k was the
    last one written."""

    def __init__(self, metrics: Path, interval_s: float = 0.5) -> None:
        self.metrics, self.interval_s = metrics, interval_s
        self.used_at: dict[int, int] = {}
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=10, check=True,
                ).stdout  # fmt: skip
            except (OSError, subprocess.SubprocessError):
                return  # no GPU tool
            used = int(out.split()[0])
            steps = len(self.metrics.read_text().splitlines()) if self.metrics.exists() else 0
            self.used_at[steps] = max(self.used_at.get(steps, 0), used)
            self.peak = max(self.peak, used)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def write_model(preset: str, out: Path, dtype: str, device: str) -> tuple[Path, int]:
    import torch

    from relax.models.tiny import count_parameters, write_tiny_model
    from relax.models.tokenizer import train_tiny_tokenizer

    tok = train_tiny_tokenizer(4096 if preset != "tiny" else 512)
    vocab = 151936 if preset != "tiny" else 512
    init_device = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    kwargs = dict(family="qwen2", tokenizer=tok, dtype=dtype, vocab_size=vocab, **PRESETS[preset])
    if preset != "tiny":  # Qwen2.5's context: room for --new-tokens 2048 and more after the prompt
        kwargs["max_position_embeddings"] = 32768
    try:
        path = write_tiny_model(out, device=init_device, **kwargs)
    except TypeError:  # a tree from before `device` (the "before" run of a comparison): on the CPU
        path = write_tiny_model(out, **kwargs)
    if init_device == "cuda":
        torch.cuda.empty_cache()  # the run's roles get the GPU; this process keeps only its context
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        n = count_parameters(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))
    return path, n


def median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen2.5-0.5b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out (compiles happen there)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument(
        "--profile-step",
        type=int,
        default=None,
        help="profile this step (default warmup + 1; 0: none); the profiler slows its step, which the "
        "medians leave out",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--out", default=None, help="where the trace and the run go (default: a temporary dir)")
    p.add_argument("--base-config", default="examples/quickstart.yaml")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    for name in ("relax.backends.training.update", "relax.orchestration.gpus"):
        logging.getLogger(name).setLevel(logging.INFO)
    out = Path(args.out or tempfile.mkdtemp(prefix="relax-rl-step-"))
    out.mkdir(parents=True, exist_ok=True)
    args.profile_step = args.warmup + 1 if args.profile_step is None else args.profile_step
    if args.profile_step > 0:  # read by the training rank (Ray passes them on)
        os.environ["RELAX_PROFILE_STEPS"] = str(args.profile_step)
        os.environ["RELAX_PROFILE_DIR"] = str(out / "profile")

    cuda = args.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    t0 = time.perf_counter()
    model, n_params = write_model(args.preset, out / "model", dtype, args.device)
    data = write_data(out / "prompts.jsonl", 4000, seed=0)
    write_s = time.perf_counter() - t0

    from relax.config import load_config
    from relax.orchestration.controller import Controller

    overrides = [
        f"model.path={model}", f"model.dtype={dtype}", f"data.train_files=[{data}]",
        "data.apply_chat_template=false", "data.max_prompt_len=1024", f"run.output_dir={out / 'runs'}",
        f"run.name={args.preset}", "schedule.mode=colocate", "schedule.max_staleness=0",
        f"rollout.prompts_per_step={args.prompts}", f"rollout.n_samples_per_prompt={args.n}",
        f"rollout.max_new_tokens={args.new_tokens}", "rollout.temperature=1.0", "reward.name=token_rate",
        "algorithm.name=grpo", "algorithm.kl_coef=0.0", "algorithm.entropy_coef=0.0",
        f"trainer.num_steps={args.steps}", "trainer.lr=1e-6", "trainer.num_mini_batches=1",
        "trainer.backend=fsdp", "trainer.num_ranks=1", f"trainer.device={args.device}",
        "ops.checkpoint_interval=0", "ops.progress=false", "ops.tensorboard=false", "ops.log_interval=1",
        "ops.trace=true", "eval.sets=[]", "eval.before_train=false",
    ]  # fmt: skip
    cfg = load_config(args.base_config, [*overrides, *args.set])
    metrics_path = cfg.run.run_dir / "metrics.jsonl"
    t1 = time.perf_counter()
    reported, lock = threading.Event(), threading.Lock()

    def report_once() -> None:
        with lock:
            if not reported.is_set():
                report(args, metrics_path, mem, n_params, t1, write_s, out, cuda)
                reported.set()

    def report_when_done() -> None:
        # the numbers go out once the last step's row is written: the run's final checkpoint (the
        # trainer's whole state) can take longer than a benchmark's time limit allows
        while not reported.wait(1.0):
            if metrics_path.exists() and len(metrics_path.read_text().splitlines()) >= args.steps:
                report_once()

    with MemoryWatch(metrics_path) as mem:
        threading.Thread(target=report_when_done, daemon=True).start()
        Controller(cfg).run()
    report_once()


def report(
    args: argparse.Namespace,
    metrics_path: Path,
    mem: MemoryWatch,
    n_params: int,
    t1: float,
    write_s: float,
    out: Path,
    cuda: bool,
) -> None:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    # the profiled step runs 2.5-3x slower (the profiler records every kernel of the rank): not steady
    steady = [r for r in rows[args.warmup :] if r["step"] != args.profile_step] or rows[args.warmup :] or rows
    tokens = [
        r["rollout/num_samples"] * (r["rollout/prompt_len_mean"] + r["rollout/response_len_mean"])
        for r in steady
    ]
    tok = statistics.median(tokens)
    phases = {name: median(steady, key) for name, key in PHASES}
    fwd_s = phases["  rank forward"] or phases["  old log-probs"]
    upd_s = phases["  rank update"] or phases["  update"]
    peak = PEAK_FLOPS if cuda else float("nan")
    last = len(rows)
    early = min(5, last)
    result = {
        "preset": args.preset,
        "params": n_params,
        "steps": last,
        "warmup": args.warmup,
        "profiled_step": args.profile_step or None,
        "steady_steps": [r["step"] for r in steady],
        "tokens_per_step": tok,
        "generated_tokens_per_step": statistics.median(
            r["rollout/num_samples"] * r["rollout/response_len_mean"] for r in steady
        ),
        "phases_s": {k: v for k, v in phases.items() if v is not None},
        "mfu_forward": 2 * n_params * tok / fwd_s / peak if fwd_s and fwd_s > 0.005 else None,
        "mfu_update": 6 * n_params * tok / upd_s / peak if upd_s else None,
        "rank_peak_memory_gb": max((r.get("perf/rank_peak_memory_gb", 0.0) for r in rows), default=None),
        "rank_reserved_gb": {k: rows[k - 1].get("perf/rank_reserved_memory_gb") for k in (early, last)},
        "gpu_used_mib": {k: mem.used_at.get(k) for k in (early, last)},
        "gpu_peak_mib": mem.peak,
        "micro_batch_tokens": rows[-1].get("perf/micro_batch_tokens"),
        "activation_checkpointing": rows[-1].get("perf/activation_checkpointing"),
        "loss": [round(r["train/loss"], 6) for r in rows],
        "logp_gap_mean": [round(r.get("train/rollout_logp_abs_diff_mean", float("nan")), 5) for r in rows],
        "logp_gap_max": [round(r.get("train/rollout_logp_abs_diff_max", float("nan")), 4) for r in rows],
        "reward": [round(r["rollout/reward_mean"], 4) for r in rows],
        "step_s": [round(r["perf/step_time_s"], 3) for r in rows],
        # rows the engine preempted for want of KV memory (a ceiling too low for the workload), per step
        "engine_preempted": [r.get("rollout/engine_preempted") for r in rows],
        # the engine's mean step and its tokens per busy second, per step: beside `benchmarks/engine.py`'s
        # full-batch step, whether the rollout's decode is slower inside a run or only surrounded by more
        "engine_step_ms": [r.get("rollout/engine_step_ms") for r in rows],
        "engine_busy_tok_s": [r.get("rollout/engine_busy_tok_s") for r in rows],
        "wall_s": round(time.perf_counter() - t1, 1),
        "model_write_s": round(write_s, 1),
        "profile": str(out / "profile"),
        "metrics": str(metrics_path),
        "overrides": args.set,
    }
    print(f"\n{args.preset}: {n_params / 1e6:.0f} M parameters, {tok:.0f} tokens a step "
          f"(medians of steps {result['steady_steps']}"
          + (f"; step {args.profile_step} profiled, left out)" if args.profile_step else ")"))  # fmt: skip
    for name, v in phases.items():
        if v is not None:
            print(f"  {name:<22}{v:8.3f} s")
    for what in ("mfu_forward", "mfu_update"):
        if result[what]:
            print(f"  {what:<22}{result[what]:8.1%}")
    print(f"  rank peak memory {result['rank_peak_memory_gb']} GB; GPU used (MiB) {result['gpu_used_mib']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
