"""Training throughput of the FSDP2 backend: tokens/s, MFU on GPU, and weight-publish (gather) time.

One in-process rank (world size 1) on a randomly initialised model of a preset's shape; a GRPO loss on
random tokens with random +-1 advantages. MFU = 6 x parameters x trained tokens / time / peak, with the
H200's public dense bf16 peak of 989 TFLOP/s (attention FLOPs are not counted, as usual for this formula).

    python benchmarks/trainer.py --preset qwen2.5-0.5b --dtype bfloat16 --device cuda
    python benchmarks/trainer.py --preset tiny --device cpu --batch 8 --seq 64     # a CPU smoke run
    python benchmarks/trainer.py --preset qwen2.5-0.5b --dtype bfloat16 --device cuda --head  # lm head only

The last line printed is a JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

logger = logging.getLogger("relax.benchmarks.trainer")

PEAK_FLOPS = {"cuda": 989e12}  # H200 dense bf16, the public datasheet basis
PRESETS = {
    # Qwen2.5-0.5B: 24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864, vocab 151936, tied embeddings
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=512,
        tie_word_embeddings=True,
    ),
}


def write_model(preset: str, dtype: str, out: Path) -> int:
    """Save a random-initialised model of the preset's shape; return its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**PRESETS[preset])
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_batch(n: int, seq: int, prompt_len: int, vocab: int, ragged: int = 0):
    """`n` rows of `prompt_len` + `seq - prompt_len` tokens; with `ragged` = a response cap, rows come in
    groups of 8 sharing a prompt of 32-512 tokens, with responses of min(cap, 16 x Pareto(1)) tokens
    (the shape of benchmarks/gpu_e2e.py's workload)."""
    import random

    from relax.data.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    lengths = []
    for i in range(n):
        if not ragged:
            lengths.append((prompt_len, seq - prompt_len))
        elif i % 8 == 0:
            p, r = rng.randint(32, 512), int(min(ragged, 16 * rng.paretovariate(1.0)))
            lengths += [(p, r)] * min(8, n - i)
    rows = [torch.randint(0, vocab, (p + r,), generator=g).tolist() for p, r in lengths]
    b = TrainBatch(
        prompt_ids=[row[:p] for row, (p, _) in zip(rows, lengths, strict=True)],
        response_ids=[row[p:] for row, (p, _) in zip(rows, lengths, strict=True)],
        loss_mask=[[1.0] * r for _, r in lengths],
        rollout_log_probs=[[0.0] * r for _, r in lengths],
        rewards=[float(i % 2) for i in range(n)],
        group_index=[i // 8 for i in range(n)],
        weight_versions=[0] * n,
    )
    b.advantages = [torch.full((r,), 1.0 if i % 2 else -1.0) for i, (_, r) in enumerate(lengths)]
    return b


def bench_head(args: argparse.Namespace) -> None:
    """Forward + backward of the lm head on `--micro-tokens` random tokens: the chunked autograd function
    against full [N, V] fp32 logits. Prints times, peak memory and the differences of the results."""
    from relax.backends.training.logprobs import token_logprobs

    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    shape = PRESETS[args.preset]
    N, H, V = args.micro_tokens, shape["hidden_size"], shape["vocab_size"]
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(N, H, device=dev, generator=g).to(dt).requires_grad_()
    weight = (torch.randn(V, H, device=dev, generator=g) * 0.02).to(dt).requires_grad_()
    targets = torch.randint(0, V, (N,), device=dev, generator=g)
    up_logp, up_ent = torch.randn(N, device=dev, generator=g), torch.randn(N, device=dev, generator=g)
    use_ent = args.entropy_coef > 0

    def full():
        logits = (hidden @ weight.T).float()
        lse = torch.logsumexp(logits, -1)
        logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
        ent = lse - (torch.softmax(logits, -1) * logits).sum(-1)
        return logp, ent

    def chunked():
        return token_logprobs(hidden, weight, targets)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out: dict = {"tokens": N, "vocab": V, "entropy_grad": use_ent}
    for name, fn in [("chunked", chunked), ("full", full)]:
        hidden.grad = weight.grad = None
        times = []
        for it in range(args.warmup + args.steps):
            if it == args.warmup and dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            logp, ent = fn()
            loss = (logp * up_logp).sum() + ((ent * up_ent).sum() if use_ent else 0.0)
            hidden.grad = weight.grad = None
            loss.backward()
            sync()
            times.append(time.perf_counter() - t0)
        out[f"{name}_ms"] = 1e3 * sum(times[args.warmup :]) / args.steps
        if dev.type == "cuda":
            out[f"{name}_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out[name] = [t.detach().float() for t in (logp, ent, hidden.grad, weight.grad)]
    for i, what in enumerate(["logp", "entropy", "grad_hidden", "grad_weight"]):
        a, b = out["chunked"][i], out["full"][i]
        out[f"{what}_rel_err"] = float((a - b).norm() / b.norm().clamp(min=1e-30))
        out[f"{what}_max_abs"] = float((a - b).abs().max())
    del out["chunked"], out["full"]
    logger.info("lm head: chunked %.1f ms, full logits %.1f ms", out["chunked_ms"], out["full_ms"])
    print(json.dumps(out))


def sync_sites(worker, batch, loss_fn) -> dict[str, int]:
    """{file:line: count} of the synchronizing CUDA calls of one training step (torch's sync debug mode)."""
    import collections
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            worker.train_minibatches([batch], loss_fn)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites = collections.Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    for site, n in sites.most_common():
        logger.info("host waits for the GPU at %s: %d times a step", site, n)
    return dict(sites)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--dtype", default="float32", help="model dtype (bf16 mixed precision on cuda)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (prompt + response)")
    p.add_argument(
        "--prompt-len", type=int, default=8, help="prompt tokens (logits are computed for the rest)"
    )
    p.add_argument(
        "--ragged",
        type=int,
        default=0,
        help="response cap: rows of mixed length as in benchmarks/gpu_e2e.py (--seq/--prompt-len unused)",
    )
    p.add_argument("--micro-tokens", type=int, default=16384, help="token budget of one micro-batch")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="print the top kernels of one profiled step")
    p.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus (its gradient then runs)")
    p.add_argument(
        "--keep-gathered",
        action="store_true",
        help="FSDP reshard_after_forward=False (no gather in backward)",
    )
    p.add_argument(
        "--head", action="store_true", help="only time the lm head: chunked log-probs vs full logits"
    )
    p.add_argument(
        "--sync-debug",
        action="store_true",
        help="count the operations of one step that make the host wait for the GPU, by source line",
    )
    p.add_argument(
        "--attention-kernel",
        choices=["auto", "flash", "cudnn"],
        default="auto",
        help="trainer.attention_kernel (docs/trainer.md, Attention kernel)",
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.head:
        bench_head(args)
        return
    train(args)


def train(args: argparse.Namespace) -> None:
    from relax.algorithms import AlgorithmConfig
    from relax.algorithms.pipeline import make_policy_loss
    from relax.backends.training.fsdp import FSDPWorker
    from relax.backends.training.update import merge_partials
    from relax.config import TrainerConfig

    tmp = Path(tempfile.mkdtemp(prefix="relax-bench-"))
    n_params = write_model(args.preset, args.dtype, tmp)
    cfg = TrainerConfig(
        backend="fsdp",
        device=args.device,
        lr=1e-6,
        threads=args.threads,
        max_tokens_per_micro_batch=args.micro_tokens,
        gradient_checkpointing=args.grad_ckpt,
        compile_layers=args.compile,
        mixed_precision="bf16" if args.dtype == "bfloat16" else "none",
        attention_kernel=args.attention_kernel,
    )
    worker = FSDPWorker(
        str(tmp),
        cfg,
        dtype=args.dtype,
        total_steps=args.warmup + args.steps,
        reshard_after_forward=not args.keep_gathered,
    )
    worker.setup("127.0.0.1", _free_port())
    vocab = PRESETS[args.preset]["vocab_size"]
    batch = make_batch(args.batch, args.seq, args.prompt_len, vocab, args.ragged)
    loss_fn = make_policy_loss(
        AlgorithmConfig(entropy_coef=args.entropy_coef), tensor_metrics=True
    )  # as the Actor
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    batch.old_log_probs = worker.compute_log_probs(batch)  # untimed: the first pass warms up
    sync()
    t0 = time.perf_counter()
    batch.old_log_probs = worker.compute_log_probs(batch)
    sync()
    logp_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        worker.train_minibatches([batch], loss_fn)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        metrics = merge_partials([worker.train_minibatches([batch], loss_fn)])
    sync()
    step_s = (time.perf_counter() - t0) / args.steps
    syncs = sync_sites(worker, batch, loss_fn) if args.sync_debug and args.device == "cuda" else None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            worker.train_minibatches([batch], loss_fn)
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True))
    publish = worker.gather_and_send(worker.step, "full", args.dtype)  # gather + cast (no engines attached)
    result = {
        "preset": args.preset,
        "device": args.device,
        "dtype": args.dtype,
        "params": n_params,
        "tokens_per_step": tokens,
        "step_s": step_s,
        "train_tokens_per_s": tokens / step_s,
        "logprob_tokens_per_s": tokens / logp_s,
        "publish_s": publish["perf/weight_publish_s"],
        "publish_bytes": publish["perf/weight_sync_bytes"],
        "loss": metrics["train/loss"],
        "grad_ckpt": args.grad_ckpt,
        "compile": args.compile,
        "micro_tokens": args.micro_tokens,
        "ragged": args.ragged,
        "entropy_coef": args.entropy_coef,
        "keep_gathered": args.keep_gathered,
        "attention_kernel": args.attention_kernel,
        "host_waits": syncs,
    }
    if args.device in PEAK_FLOPS:
        result["mfu"] = 6 * n_params * tokens / step_s / PEAK_FLOPS[args.device]
        result["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
    logger.info(
        "%.0f train tokens/s (%.3fs/step)%s; publish %.3fs for %.1f MB",
        result["train_tokens_per_s"],
        step_s,
        f", MFU {result['mfu']:.1%}" if "mfu" in result else "",
        result["publish_s"],
        result["publish_bytes"] / 1e6,
    )
    worker.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
