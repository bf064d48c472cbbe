"""Multi-turn agent sessions against the embedded engine, with its prefix cache on and off. Not a test.

Every session starts with the same system prompt and a user message of its own; each turn the engine
answers the whole conversation so far (`--turn-tokens` new tokens, EOS ignored), then a tool observation
of `--obs-len` random tokens is appended, as an agent's next turn would send it. The sessions advance
turn by turn together (every session's turn k is submitted at once, as a batch of RL rollouts does).
Each mode runs the workload once untimed (allocator, CUDA graphs), then `--repeats` times timed, the
cache emptied before each (as the weight update before an RL step does); the median pass counts. Printed per mode: seconds, generated tokens per
second, prompt tokens prefilled vs submitted, the cache's hit rate; then the throughput ratio and the
roofline of the workload's decode steps (`engine.py`'s: bytes a step moves / 4.8 TB/s and FLOPs / 989
TFLOP/s dense bf16, the H200's datasheet figures; prefill left out). The last line printed is one JSON
object.

    python benchmarks/agent_turns.py                 # CPU: tiny model, 64 sessions of 4 turns
    python benchmarks/agent_turns.py --preset qwen2.5-0.5b --device cuda --dtype bfloat16 \
        --system-len 512 --user-len 128 --turn-tokens 128 --obs-len 64
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from relax.backends.inference.embedded.engine import EmbeddedEngine
from relax.utils.gc_freeze import freeze_startup_objects

logger = logging.getLogger("benchmarks.agent_turns")


def run_sessions(engine: EmbeddedEngine, args: argparse.Namespace, vocab: int) -> dict:
    """One pass of the workload; returns its seconds and generated tokens."""
    rng = random.Random(0)
    system = [rng.randrange(1, vocab) for _ in range(args.system_len)]
    convs = [system + [rng.randrange(1, vocab) for _ in range(args.user_len)] for _ in range(args.sessions)]
    params = {"temperature": 1.0, "ignore_eos": True, "max_new_tokens": args.turn_tokens}
    # the tool observations are drawn before the clock starts (the same draws, in the same order, as
    # drawing each after its turn): 33k random.randrange calls a turn on the host are not engine work,
    # and they held the GIL between two turns of both modes alike
    obs = [[[rng.randrange(1, vocab) for _ in range(args.obs_len)] for _ in convs] for _ in range(args.turns)]
    generated, turn_s = 0, []
    t0 = time.perf_counter()
    for turn in range(args.turns):
        futures = [engine.submit(c, params) for c in convs]
        for i, f in enumerate(futures):
            out = f.result()[0].output_ids
            generated += len(out)
            convs[i] = convs[i] + out + obs[turn][i]
        turn_s.append(round(time.perf_counter() - t0 - sum(turn_s), 4))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - t0, "generated": generated, "turn_s": turn_s}


def workload_tokens(args: argparse.Namespace) -> int:
    """Tokens of every session's conversation after its last turn: what an engine sized by its GPU's
    memory holds for this workload (the 0.5B shape keeps 12 KB a token: 64 sessions of 10 search turns
    are 0.53M tokens, 6.5 GB). A smaller budget makes the cache evict and the engine preempt, which
    measures those instead of the cache's gain."""
    per_session = args.system_len + args.user_len + args.turns * (args.turn_tokens + args.obs_len)
    return max(args.sessions * per_session, 4096)


def bench(model_dir: Path, args: argparse.Namespace, vocab: int, cache: bool, packed: bool = True) -> dict:
    """Time the workload with the prefix cache on or off; `packed=False` turns the packed prefill past
    cached prefixes off (the masked path instead: `packed_prefill.py`)."""
    engine = EmbeddedEngine(
        str(model_dir),
        device=args.device,
        dtype=args.dtype,
        max_running=args.sessions,
        max_total_tokens=args.max_total_tokens or workload_tokens(args),
        seed=0,
        enable_prefix_cache=cache,
        chunked_prefill_size=args.chunked_prefill_size,
    )
    engine.runner.packed_prefill = engine.runner.packed_prefill and packed
    engine.start()
    freeze_startup_objects()  # as a serving process does (relax engine serve, the engine's Ray actor)
    timeline = None
    if args.timeline:
        from engine import StepTimeline  # benchmarks/engine.py, beside this script

        timeline = StepTimeline(engine.scheduler)
    try:
        run_sessions(engine, args, vocab)  # untimed
        times = []
        for i in range(args.repeats):
            if timeline is not None:  # the last pass
                timeline.recording = i == args.repeats - 1
            t_pass = time.perf_counter()
            engine.flush_cache()
            s = engine.scheduler
            computed, submitted, preempted = s.prefill_computed, s.prefill_submitted, s.preempted
            hits, lookups = (s.prefix.hit_tokens, s.prefix.lookup_tokens) if s.prefix else (0, 0)
            r = run_sessions(engine, args, vocab)
            times.append(r["seconds"])
            if timeline is not None and timeline.recording:
                summary = timeline.summary(t_pass, t_pass + r["seconds"])
                logger.info("engine timeline (cache %s): %s", "on" if cache else "off", json.dumps(summary))
        r["seconds"] = statistics.median(times)  # the counts are the same in every pass
        r["prefill_computed"] = s.prefill_computed - computed
        r["prefill_submitted"] = s.prefill_submitted - submitted
        r["preempted"] = s.preempted - preempted
        if s.prefix is not None:
            r["hit_rate"] = (s.prefix.hit_tokens - hits) / max(s.prefix.lookup_tokens - lookups, 1)
    finally:
        engine.shutdown()
        if timeline is not None:
            timeline.close()
    r["tok_s"] = r["generated"] / r["seconds"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=["tiny", "qwen2.5-0.5b", "qwen2.5-1.5b"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--sessions", type=int, default=64, help="Concurrent agent sessions.")
    ap.add_argument("--turns", type=int, default=4, help="Model turns per session.")
    ap.add_argument("--system-len", type=int, default=128, help="Tokens of the shared system prompt.")
    ap.add_argument("--user-len", type=int, default=32, help="Tokens of each session's first message.")
    ap.add_argument("--turn-tokens", type=int, default=16, help="New tokens per model turn.")
    ap.add_argument("--obs-len", type=int, default=16, help="Tokens of each tool observation.")
    ap.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="The engine's KV budget (default: every session's whole conversation; less measures eviction).",
    )
    ap.add_argument("--repeats", type=int, default=3, help="Timed passes per mode; the median counts.")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU.")
    ap.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="Prefill tokens a step (-1: off; default: the engine's).",
    )
    ap.add_argument("--timeline", action="store_true", help="Log where the last timed pass spends time.")
    ap.add_argument(
        "--also-masked",
        action="store_true",
        help="Also time the cache on with the masked prefill past cached prefixes (the packed one's baseline).",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    from engine import roofline, write_model  # benchmarks/engine.py, beside this script

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(args.preset, args.dtype, Path(tmp) / "model")
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        off = bench(model_dir, args, vocab, cache=False)
        logger.info("prefix cache off: %s", off)
        on = bench(model_dir, args, vocab, cache=True)
        logger.info("prefix cache on:  %s", on)
        masked = bench(model_dir, args, vocab, cache=True, packed=False) if args.also_masked else None
        if masked is not None:
            logger.info("prefix cache on, masked prefill: %s", masked)
        steps, context = [], args.system_len + args.user_len
        for _turn in range(args.turns):  # every session decodes its turn together
            steps += [(args.sessions, args.sessions * (context + t + 1)) for t in range(args.turn_tokens)]
            context += args.turn_tokens + args.obs_len
        bound = roofline(model_dir, args.dtype, steps, on["generated"], on["seconds"])
    result = {
        "preset": args.preset,
        "device": args.device,
        "sessions": args.sessions,
        "turns": args.turns,
        "off": off,
        "on": on,
        "speedup": round(on["tok_s"] / off["tok_s"], 3),
        **({"masked": masked, "speedup_masked": round(masked["tok_s"] / off["tok_s"], 3)} if masked else {}),
        "prefill_saved": round(1 - on["prefill_computed"] / max(on["prefill_submitted"], 1), 3),
        **(bound if args.preset != "tiny" else {}),
    }
    print(f"prefix cache: {result['speedup']}x the throughput, hit rate {on.get('hit_rate', 0):.1%}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
