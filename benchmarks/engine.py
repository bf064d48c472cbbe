"""Throughput of the embedded engine against plain `transformers` `generate`, in the same run, on the same
model, prompts and sampling settings (temperature 1, no truncation, EOS ignored), `--repeats` times each,
alternating; the ratio is of the median times. Not a test.

    python benchmarks/engine.py                      # CPU: tiny model, 64 requests, 8..128 new tokens
    python benchmarks/engine.py --preset qwen2.5-0.5b --device cuda --dtype bfloat16 \
        --prompts 256 --prompt-len 128 --new-tokens 256          # also 2048, 8192; qwen2.5-1.5b

Every run prints its roofline (`roofline`): the bytes a decode step moves (the weights, once, and the KV
cache each row reads) at the H200's 4.8 TB/s, and the FLOPs (2 per weight per token, plus attention) at
its 989 TFLOP/s dense bf16, both datasheet figures, summed over the workload's steps; `roofline_pct` is the
share of that bound the engine reached.

`--itl` measures instead the inter-token latency of running decodes while long prompts arrive, chunked
prefill off and on (`--chunked-prefill-size`, default the engine's), on one engine, alternating passes:

    python benchmarks/engine.py --itl                # CPU: tiny model, 8 decodes, 2 prompts of 1536 tokens
    python benchmarks/engine.py --itl --preset qwen2.5-0.5b --device cuda --dtype bfloat16 \
        --prompts 64 --new-tokens 4096 --long-prompts 4 --long-len 16000

Output lengths are uniform in [--min-new-tokens, --new-tokens] (equal when the two match). `generate`
runs the prompts the way a user would: batches of `--hf-batch-size` prompts (default: all at once), each
batch generating as many tokens as its longest request needs; only the tokens a request asked for count.
The engine gets every request at once through `submit`. Each side runs the whole workload once untimed
(allocator, KV-cache growth, CUDA graphs), then once timed, as an engine serving RL steps one after
another does. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.utils.gc_freeze import freeze_startup_objects

logger = logging.getLogger("benchmarks.engine")

QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)


QWEN25_15B = QWEN25_05B | dict(
    hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, intermediate_size=8960
)
PRESETS = {"qwen2.5-0.5b": QWEN25_05B, "qwen2.5-1.5b": QWEN25_15B}
HBM_BYTES_S = 4.8e12  # H200 datasheet HBM3e bandwidth
BF16_FLOPS = 989e12  # H200 SXM datasheet dense bf16


def write_model(preset: str, dtype: str, out: Path) -> Path:
    """A random-initialised checkpoint (no download): the tiny test model or a Qwen2.5 shape (context
    32,768, so outputs of 8k tokens fit)."""
    if preset == "tiny":
        from relax.models.tiny import write_tiny_model

        return write_tiny_model(out, family="qwen2", dtype=dtype)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**PRESETS[preset])).to(getattr(torch, dtype)).save_pretrained(out)
    return out


def decode_bound(model_dir: Path, dtype: str, steps: list[tuple[int, int]]) -> tuple[float, float]:
    """Seconds the decode steps (rows, keys attended by all rows) take at best on an H200: each step reads
    every weight once and each row its KV so far (bytes / 4.8 TB/s), and does 2 FLOPs per weight per row
    plus 4 per attended key per query head dimension (FLOPs / 989 TFLOP/s dense bf16). Returns the
    (bandwidth, FLOPs) bounds, each summed over the steps."""
    cfg = Qwen2Config.from_pretrained(model_dir)
    h, L, Hq = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads
    Hk, D = cfg.num_key_value_heads, h // cfg.num_attention_heads
    per_layer = h * (Hq + 2 * Hk) * D + Hq * D * h + 3 * h * cfg.intermediate_size
    params = L * per_layer + h * cfg.vocab_size  # the LM head (tied: the embedding, read once)
    width = torch.finfo(getattr(torch, dtype)).bits // 8
    kv_token = L * 2 * Hk * D * width
    bw_s = sum(params * width + keys * kv_token for _, keys in steps) / HBM_BYTES_S
    flop_s = sum(2 * params * rows + 4 * keys * L * Hq * D for rows, keys in steps) / BF16_FLOPS
    return bw_s, flop_s


# HBM bandwidth of the card measured on, by name, where it is not the H200 the roofline's basis is: the
# H100 SXM's datasheet 3.35 TB/s (its dense bf16 is the H200's 989 TFLOP/s)
CARD_HBM_BYTES_S = {"H100 80GB HBM3": 3.35e12}


def roofline(model_dir: Path, dtype: str, steps: list[tuple[int, int]], tokens: int, seconds: float) -> dict:
    """The roofline of a workload's decode steps (`decode_bound`; prefill left out) against its time, on
    the H200 basis; on a card of `CARD_HBM_BYTES_S` also against that card's own bandwidth."""
    bw_s, flop_s = decode_bound(model_dir, dtype, steps)
    bound = max(bw_s, flop_s)
    out = {
        "roofline": "decode steps only; H200 datasheet: 4.8 TB/s HBM, 989 TFLOP/s dense bf16",
        "roofline_bandwidth_s": round(bw_s, 3),
        "roofline_flops_s": round(flop_s, 3),
        "roofline_tok_s": round(tokens / bound, 1),
        "roofline_pct": round(100 * bound / seconds, 1),
    }
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    for name, hbm in CARD_HBM_BYTES_S.items():
        if name in card:
            card_bound = max(bw_s * HBM_BYTES_S / hbm, flop_s)
            out["card"] = f"{card}: {hbm / 1e12} TB/s datasheet HBM"
            out["card_roofline_pct"] = round(100 * card_bound / seconds, 1)
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def logprob_gap(model, prompts: list[list[int]], outs: list) -> dict:
    """Engine log-probs against the `transformers` forward's log_softmax (T = 1) of the same tokens, over
    the first 8 requests: mean and max absolute difference."""
    diffs = []
    with torch.inference_mode():
        for prompt, out in list(zip(prompts, outs, strict=True))[:8]:
            ids = torch.tensor([prompt + out.output_ids], device=model.device)
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
            ref = logp.gather(1, torch.tensor(out.output_ids, device=model.device)[:, None])[:, 0]
            diffs.append((ref.cpu() - torch.tensor(out.output_logprobs)).abs())
    d = torch.cat(diffs)
    return {"logprob_diff_mean": round(float(d.mean()), 4), "logprob_diff_max": round(float(d.max()), 4)}


def bench_generate(model_dir: Path, args: argparse.Namespace, prompts: list[list[int]], lengths: list[int]):
    """Seconds `generate` takes over all prompts, batched as a user would (left padding, sampling), and
    the engine log-probs' gap to this model's (see `logprob_gap`)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    gap = logprob_gap(model, prompts, args.engine_outs)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
    bs = args.hf_batch_size or len(prompts)
    order = (
        sorted(range(len(prompts)), key=lambda i: lengths[i])
        if bs < len(prompts)
        else list(range(len(prompts)))
    )
    with torch.inference_mode():
        ids = torch.tensor(prompts[:2], device=args.device)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4, **kw)
        for _timed in (False, True):  # the workload once untimed (as the engine gets it), then timed
            sync(args.device)
            t0 = time.perf_counter()
            for start in range(0, len(order), bs):
                idx = order[start : start + bs]
                ids = torch.tensor([prompts[i] for i in idx], device=args.device)
                n = max(lengths[i] for i in idx)
                model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, **kw
                )
            sync(args.device)
            seconds = time.perf_counter() - t0
    del model
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return seconds, gap


class StepTimeline:
    """Wraps the engine's `Scheduler.step` to record each step of one pass: when it ran, how long it took,
    the rows it decoded and the requests it admitted; `summary()` splits the pass's time into ramp (until
    the last request is admitted), full-batch steps, tail (after the first row finishes) and gaps between
    steps (the engine thread's command handling and waits), and the steps' time into those that admitted
    requests (their prefills) and the rest (decode only): a multi-turn pass admits in every turn."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.inner, self.steps = scheduler, scheduler.step, []
        self.recording = False
        scheduler.step = self.step
        # prefill_after: past cached prefixes; gc: wall time inside collections over the whole pass, any
        # thread: an upper bound on their cost, since the GPU runs the steps queued meanwhile and the
        # other threads wait only where they need the GIL (docs/measurements.md: off, a pass was as long)
        self.spent = {"prefill_s": 0.0, "prefill_after_s": 0.0, "capture_s": 0.0, "gc_s": 0.0}
        self._gc_started = 0.0
        gc.callbacks.append(self._gc)
        runner = scheduler.runner
        runner.prefill = self._timed(runner.prefill, "prefill_s", runner.device)
        runner.prefill_after = self._timed(runner.prefill_after, "prefill_after_s", runner.device)
        if runner.graphs is not None:
            runner.graphs._capture = self._timed(runner.graphs._capture, "capture_s", runner.device)

    def close(self) -> None:
        gc.callbacks.remove(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self.recording:
            self.spent["gc_s"] += time.perf_counter() - self._gc_started

    def _timed(self, fn, key: str, device: torch.device):
        def wrapper(*a, **kw):
            if not self.recording:
                return fn(*a, **kw)
            sync(device.type)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            sync(device.type)
            self.spent[key] += time.perf_counter() - t0
            return out

        return wrapper

    def step(self) -> int:
        s = self.scheduler
        if not self.recording:
            return self.inner()
        waiting, graphs = s.num_waiting(), self._graphs()
        t0 = time.perf_counter()
        n = self.inner()
        t1 = time.perf_counter()
        admitted = waiting - s.num_waiting()
        self.steps.append((t0, t1, len(s.running), admitted, self._graphs() - graphs))
        return n

    def _graphs(self) -> int:
        graphs = getattr(self.scheduler.runner, "graphs", None)
        return len(graphs.graphs) if graphs is not None else 0

    def summary(self, t_start: float, t_end: float) -> dict:
        st = self.steps
        if not st:
            return {}
        last_admit = max((i for i, x in enumerate(st) if x[3] > 0), default=0)
        full = max(x[2] for x in st)
        first_drop = next((i for i, x in enumerate(st) if i > last_admit and x[2] < full), len(st))
        busy = sum(x[1] - x[0] for x in st)
        mid = sorted(x[1] - x[0] for x in st[last_admit + 1 : first_drop]) or [0.0]
        return {
            "steps": len(st),
            "before_first_step_s": round(st[0][0] - t_start, 4),
            "ramp_s": round(st[last_admit][1] - st[0][0], 4),
            "ramp_steps": last_admit + 1,
            "admitting_steps": sum(1 for x in st if x[3] > 0),
            "admitting_s": round(sum(x[1] - x[0] for x in st if x[3] > 0), 4),  # the prefills' steps
            "other_steps_s": round(sum(x[1] - x[0] for x in st if x[3] == 0), 4),  # decode-only steps
            "full_steps": first_drop - last_admit - 1,
            "full_step_ms_median": round(1e3 * mid[len(mid) // 2], 3),
            "full_s": round(sum(x[1] - x[0] for x in st[last_admit + 1 : first_drop]), 4),
            "tail_s": round(st[-1][1] - st[first_drop][0], 4) if first_drop < len(st) else 0.0,
            "gaps_s": round((st[-1][1] - st[0][0]) - busy, 4),
            "after_last_step_s": round(t_end - st[-1][1], 4),
            "graphs_captured": sum(x[4] for x in st),
            **{k: round(v, 4) for k, v in self.spent.items()},
            "slowest_steps": [  # (index, ms, rows after, requests admitted, graphs captured)
                (i, round(1e3 * (x[1] - x[0]), 1), *x[2:])
                for i, x in sorted(enumerate(st), key=lambda e: e[1][0] - e[1][1])[:6]
            ],
        }


def bench_engine(model_dir: Path, args: argparse.Namespace, prompts: list[list[int]], lengths: list[int]):
    engine = EmbeddedEngine(
        str(model_dir),
        device=args.device,
        dtype=args.dtype,
        max_running=len(prompts),
        max_total_tokens=args.max_total_tokens or len(prompts) * (len(prompts[0]) + max(lengths) + 16),
        seed=0,
        cuda_graphs=not args.no_cuda_graphs,
        overlap=False if args.no_overlap else None,
        enable_prefix_cache=not args.no_prefix_cache,
        kv_preallocate=args.preallocate,
    ).start()
    freeze_startup_objects()  # as a serving process does (relax engine serve, the engine's Ray actor)
    if args.sdpa_decode and engine.runner.lean is not None:
        engine.runner.lean.triton_decode = False
    params = {"temperature": 1.0, "ignore_eos": True}
    timeline = StepTimeline(engine.scheduler) if args.timeline else None
    try:
        engine.generate(prompts[0], {**params, "max_new_tokens": 4})  # warm-up
        futures = [engine.submit(p, {**params, "max_new_tokens": 2}) for p in prompts]
        [f.result() for f in futures]  # warm-up at full batch (CUDA graphs, allocator)
        for timed in (True,) if args.cold else (False, True):  # once untimed (as generate gets it), timed
            engine.flush_cache()  # cold, as after the weight update that starts every RL step
            sync(args.device)
            if timeline is not None:
                timeline.recording = timed
            t0 = time.perf_counter()
            futures = [
                engine.submit(p, {**params, "max_new_tokens": n})
                for p, n in zip(prompts, lengths, strict=True)
            ]
            outs = [f.result()[0] for f in futures]
            sync(args.device)
            seconds = time.perf_counter() - t0
            if not timed:
                logger.debug("engine warm-up pass: %.3f s", seconds)
            elif timeline is not None:
                logger.info("engine timeline: %s", json.dumps(timeline.summary(t0, t0 + seconds)))
    finally:
        engine.shutdown()
        if timeline is not None:
            timeline.close()
    assert [len(o.output_ids) for o in outs] == lengths, "the engine stopped a request early"
    args.engine_outs = outs
    return seconds


def profile_engine(model_dir: Path, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """Time and profile decode steps of a full batch on the engine thread (no submission overhead)."""
    import os

    from torch.profiler import ProfilerActivity, profile

    engine = EmbeddedEngine(
        str(model_dir),
        device=args.device,
        dtype=args.dtype,
        max_running=len(prompts),
        seed=0,
        cuda_graphs=not args.no_cuda_graphs,
    ).start()
    if args.sdpa_decode and engine.runner.lean is not None:
        engine.runner.lean.triton_decode = False
    engine.pause()
    params = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": args.new_tokens}
    futures = [engine.submit(p, params) for p in prompts]

    def work() -> dict:
        s = engine.scheduler
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        key = "self_cuda_time_total" if args.device.startswith("cuda") else "self_cpu_time_total"
        with profile(activities=acts) as prof:  # the prefills (and the first steps, with their capture)
            while s.waiting:
                s.step()
            sync(args.device)
        print("admission (prefills):", flush=True)
        print(prof.key_averages().table(sort_by=key, row_limit=20), flush=True)
        for _ in range(args.profile_after):
            s.step()
        times = []
        for _ in range(20):
            sync(args.device)
            t0 = time.perf_counter()
            s.step()
            sync(args.device)
            times.append(time.perf_counter() - t0)
        with profile(activities=acts) as prof:
            for _ in range(5):
                s.step()
            sync(args.device)
        print("five full-batch decode steps:", flush=True)
        print(prof.key_averages().table(sort_by=key, row_limit=30), flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), flush=True)
        if os.environ.get("OUT"):
            prof.export_chrome_trace(os.path.join(os.environ["OUT"], "trace.json"))
        times.sort()
        return {"batch": len(s.running), "step_ms_median": round(1e3 * times[len(times) // 2], 2)}

    try:
        out = engine._call(work)
    finally:
        engine.abort(abort_all=True)
        engine.shutdown()
    [f.result() for f in futures]
    return out


def itl_pass(engine: EmbeddedEngine, args: argparse.Namespace, prompts, long_prompts) -> dict:
    """One pass: `prompts` decode (token times stamped on the engine thread as each token is read); once
    each has 8 tokens, `long_prompts` arrive (one new token each). The window runs from their arrival to
    the last one's first token; every gap between two tokens of a running request that overlaps it
    counts (without chunking the one gap that holds the whole prefill)."""
    stamps: list[list[float]] = [[] for _ in prompts]
    params = {"temperature": 1.0, "ignore_eos": True}

    def stamp(i: int):
        return lambda *_: stamps[i].append(time.perf_counter())

    futures = [
        engine.submit(p, {**params, "max_new_tokens": args.new_tokens}, on_token=stamp(i))
        for i, p in enumerate(prompts)
    ]
    while min(len(t) for t in stamps) < 8:
        if any(f.done() for f in futures):  # failed, or too few --new-tokens
            raise RuntimeError(f"a running request ended early: {futures[0].result()}")
        time.sleep(0.001)
    arrive = time.perf_counter()
    longs = [engine.submit(p, {**params, "max_new_tokens": 1}) for p in long_prompts]
    ttft = [f.result()[0].e2e_latency for f in longs]
    done = time.perf_counter()
    engine.abort(abort_all=True)
    outs = [f.result()[0] for f in futures]
    if any(o.finish_reason["type"] != "abort" for o in outs):
        logger.warning("a running request ended before the window did: raise --new-tokens")
    gaps = [(a, b) for t in stamps for a, b in zip(t, t[1:], strict=False)]
    window = [b - a for a, b in gaps if b > arrive and a < done]  # the gaps the window overlaps
    before = [b - a for a, b in gaps if b <= arrive]
    window.sort()
    return {
        "itl_ms_max": 1e3 * window[-1] if window else float("nan"),
        "itl_ms_p99": 1e3 * window[int(0.99 * (len(window) - 1))] if window else float("nan"),
        "itl_ms_mean": 1e3 * statistics.mean(window) if window else float("nan"),
        "itl_ms_before": 1e3 * statistics.median(before) if before else float("nan"),
        "decode_tokens_per_request_in_window": len(window) / len(prompts),
        "long_ttft_s_max": max(ttft),
        "window_s": done - arrive,
    }


def bench_itl(model_dir: Path, args: argparse.Namespace, prompts, rng: random.Random, vocab: int) -> dict:
    """Chunked prefill off and on, on one engine (its scheduler's `chunk_size` set between passes, so
    both see the same captured graphs and allocations), `--repeats` alternating timed passes after one
    untimed pass of each; medians."""
    engine = EmbeddedEngine(
        str(model_dir),
        device=args.device,
        dtype=args.dtype,
        max_running=len(prompts) + args.long_prompts,
        seed=0,
        cuda_graphs=not args.no_cuda_graphs,
        chunked_prefill_size=args.chunked_prefill_size,
    ).start()
    freeze_startup_objects()
    chunk = engine.scheduler.chunk_size
    longs = [[rng.randrange(vocab) for _ in range(args.long_len)] for _ in range(args.long_prompts)]
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    try:
        for timed in [False] + [True] * args.repeats:
            for label, size in (("off", 0), ("on", chunk)):
                engine.scheduler.chunk_size = size  # between passes: no prompt is part way through
                engine.flush_cache()  # the long prompts are prefilled whole each pass
                r = itl_pass(engine, args, prompts, longs)
                if timed:
                    runs[label].append(r)
                    logger.info(
                        "chunked prefill %s: %s", label, json.dumps({k: round(v, 3) for k, v in r.items()})
                    )
    finally:
        engine.shutdown()
    med = {
        label: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]} for label, rs in runs.items()
    }
    out = {"chunked_prefill_size": chunk, "long_prompts": args.long_prompts, "long_len": args.long_len}
    out |= {"itl_off": med["off"], "itl_on": med["on"]}
    for k in ("itl_ms_max", "itl_ms_p99", "long_ttft_s_max"):
        out[f"{k}_ratio_off_on"] = round(med["off"][k] / med["on"][k], 2)
    logger.info(
        "max inter-token latency of running decodes while long prompts arrive: off %.1f ms, on %.1f ms "
        "(%.1fx); longest time to first token of a long prompt: off %.3f s, on %.3f s",
        med["off"]["itl_ms_max"], med["on"]["itl_ms_max"], out["itl_ms_max_ratio_off_on"],
        med["off"]["long_ttft_s_max"], med["on"]["long_ttft_s_max"],
    )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=["tiny", *PRESETS])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prompts", type=int, default=64, help="Concurrent requests.")
    ap.add_argument("--prompt-len", type=int, default=32, help="Tokens per prompt.")
    ap.add_argument("--new-tokens", type=int, default=128, help="Longest output.")
    ap.add_argument("--min-new-tokens", type=int, default=None, help="Shortest output (default: 8 on tiny).")
    ap.add_argument("--hf-batch-size", type=int, default=None, help="generate's batch size (default: all).")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU.")
    ap.add_argument("--skip-hf", action="store_true", help="Measure the engine only.")
    ap.add_argument("--profile", action="store_true", help="Time and profile full-batch decode steps only.")
    ap.add_argument(
        "--profile-after", type=int, default=5, help="--profile: decode steps run before the timed ones."
    )
    ap.add_argument("--repeats", type=int, default=5, help="Runs of each side, alternating; medians count.")
    ap.add_argument("--timeline", action="store_true", help="Log where the engine's timed pass spends time.")
    ap.add_argument(
        "--sdpa-decode", action="store_true", help="Decode attention by SDPA, not the Triton kernel."
    )
    ap.add_argument("--no-prefix-cache", action="store_true", help="Turn the engine's prefix cache off.")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="KV budget (default: the workload's).")
    ap.add_argument(
        "--preallocate",
        action="store_true",
        help="Allocate the whole KV budget at start, as an engine beside a trainer does (no doubling, which "
        "needs the old pool and the new one at once).",
    )
    ap.add_argument("--cold", action="store_true", help="Time the engine's first pass (no untimed one).")
    ap.add_argument("--no-overlap", action="store_true", help="Read each decode step back before the next.")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="Run the engine's decode steps eagerly.")
    ap.add_argument(
        "--itl", action="store_true", help="Running decodes' token latency as long prompts arrive."
    )
    ap.add_argument("--long-prompts", type=int, default=2, help="--itl: long prompts that arrive.")
    ap.add_argument("--long-len", type=int, default=1536, help="--itl: tokens per long prompt.")
    ap.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="--itl: the chunk size (default: the engine's).",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    low = (
        args.min_new_tokens
        if args.min_new_tokens is not None
        else (8 if args.preset == "tiny" else args.new_tokens)
    )
    rng = random.Random(0)
    lengths = [rng.randint(min(low, args.new_tokens), args.new_tokens) for _ in range(args.prompts)]
    total = sum(lengths)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(args.preset, args.dtype, Path(tmp) / "model")
        vocab = (
            AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
            if args.preset == "tiny"
            else PRESETS[args.preset]["vocab_size"]
        )
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        result = {"preset": args.preset, "device": args.device, "dtype": args.dtype, "prompts": args.prompts}
        result |= {"prompt_len": args.prompt_len, "new_tokens": [min(lengths), max(lengths)], "tokens": total}
        if args.profile:
            print(json.dumps(result | profile_engine(model_dir, args, prompts)), flush=True)
            return
        if args.itl:
            print(json.dumps(result | bench_itl(model_dir, args, prompts, rng, vocab)), flush=True)
            return
        eng_runs, hf_runs, gap = [], [], {}
        for _ in range(args.repeats):  # alternate, so a noisy spell on the machine hits both sides
            eng_runs.append(bench_engine(model_dir, args, prompts, lengths))
            logger.info("embedded engine: %.2f s, %.0f tok/s", eng_runs[-1], total / eng_runs[-1])
            if not args.skip_hf:
                hf_s, gap = bench_generate(model_dir, args, prompts, lengths)
                hf_runs.append(hf_s)
                logger.info("transformers generate: %.2f s, %.0f tok/s", hf_s, total / hf_s)
        eng_s = statistics.median(eng_runs)
        result |= {
            "repeats": args.repeats,
            "engine_s": round(eng_s, 3),
            "engine_tok_s": round(total / eng_s, 1),
        }
        if args.preset != "tiny":
            steps = []
            for t in range(max(lengths)):
                rows = sum(1 for n in lengths if n > t)
                steps.append((rows, rows * (args.prompt_len + t + 1)))
            result |= roofline(model_dir, args.dtype, steps, total, eng_s)
        if hf_runs:
            hf_s = statistics.median(hf_runs)
            ratios = sorted(h / e for h, e in zip(hf_runs, eng_runs, strict=True))
            result |= {
                "hf_s": round(hf_s, 3),
                "hf_tok_s": round(total / hf_s, 1),
                "ratio": round(hf_s / eng_s, 2),
                "ratio_per_pair": [round(r, 2) for r in ratios],
                **gap,
            }
            logger.info("ratio engine / generate (medians of %d runs): %.2fx", args.repeats, hf_s / eng_s)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
